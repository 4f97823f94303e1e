"""Issue 13's refusals and messages, one test each (the conformance suite in
tests/conformance checks the same through published shapes)."""
from __future__ import annotations

import pytest

from ddb2bt.transforms.config import mapping_from_text
from ddb2bt.transforms.errors import ConfigError, MappingError
from ddb2bt.transforms.lint import lint
from ddb2bt.transforms.mapping import map_change, parse_timestamp_ms
from ddb2bt.transforms.model import INSERT, ChangeRecord

HEAD = "source: {table: Things, key: {partition: id}}\ntarget: {project: p, instance: i, table: t}\n"


# --- plausibility of epoch timestamps ------------------------------------------------

@pytest.mark.parametrize("raw,fmt,message", [
    ("1694359308123", "epoch_seconds",
     "At: 1694359308123 as epoch_seconds is the year ~55,662; it looks like milliseconds (use format: epoch_millis)"),
    ("1694359308", "epoch_millis",
     "At: 1694359308 as epoch_millis is 1970-01-20T14:39:19Z, before 1973-03-03; it looks like seconds "
     "(use format: epoch_seconds)"),
    ("100000000000", "epoch_seconds", "At: 100000000000 as epoch_seconds is the year ~5,138"),
    ("99999999999", "epoch_millis", "At: 99999999999 as epoch_millis is 1973-03-03T09:46:39Z, before 1973-03-03"),
])
def test_an_epoch_value_in_the_other_unit_is_refused_saying_so(raw, fmt, message):
    with pytest.raises(MappingError) as err:
        parse_timestamp_ms({"N": raw}, fmt, "At")
    assert err.value.reason == "timestamp_unit"
    assert err.value.message.startswith(message)


@pytest.mark.parametrize("raw,fmt,ms", [("99999999999", "epoch_seconds", 99_999_999_999_000),
                                        ("100000000000", "epoch_millis", 100_000_000_000),
                                        ("1694359308.5", "epoch_seconds", 1_694_359_308_500)])
def test_values_on_the_right_side_of_the_boundary_are_read(raw, fmt, ms):
    assert parse_timestamp_ms({"N": raw}, fmt, "At") == ms


VERSIONED = mapping_from_text(HEAD + """
families: {c: {max_versions: 100}}
rules:
  - row_key: "{id}"
    columns:
      Body: {column: "c:body", encoding: utf8, timestamp: {attribute: At, format: epoch_seconds}}
""")


def test_a_milliseconds_value_under_epoch_seconds_is_a_dead_letter_and_lint_sample_warns():
    item = {"id": {"S": "1"}, "Body": {"S": "x"}, "At": {"N": "1694359308123"}}
    with pytest.raises(MappingError) as err:
        map_change(VERSIONED, ChangeRecord(INSERT, {"id": {"S": "1"}}, item, None, 1_700_000_000_000))
    assert err.value.reason == "timestamp_unit"
    good = {"id": {"S": "2"}, "Body": {"S": "y"}, "At": {"N": "1694359308"}}
    findings = [f for f in lint(VERSIONED, [item, good]) if f.code == "timestamp_unit"]
    assert len(findings) == 1 and findings[0].level == "WARN"
    assert findings[0].message.startswith("1 of 2 sampled items have a timestamp attribute in the other unit than "
                                          "the column's format (At: 1694359308123 as epoch_seconds is the year")


# --- sets and maps own their family -----------------------------------------------

@pytest.mark.parametrize("columns,other,message", [
    ("Tags: {family: f, as: set}\n      Attrs: {family: f, as: map}", "{mode: ignore}",
     "rules[0].columns.Attrs: family 'f' is used by both the set 'Tags' (as: set) and the map 'Attrs' (as: map)"),
    ("Tags: {family: f, as: set}", "{mode: column, family: f}",
     "rules[0].other_attributes: family 'f' is used by both the set 'Tags' (as: set) and other_attributes"),
    ("Tags: {family: f, as: set}\n      Name: {column: 'f:Name'}", "{mode: ignore}",
     "rules[0].columns.Name: family 'f' is used by both the set 'Tags' (as: set) and the column 'Name' (f:Name)"),
])
def test_set_and_map_families_are_exclusive(columns, other, message):
    body = HEAD + f"""
families: {{f: {{}}, g: {{}}}}
rules:
  - row_key: "{{id}}"
    columns:
      {columns}
    other_attributes: {other}
"""
    with pytest.raises(ConfigError) as err:
        mapping_from_text(body)
    assert str(err.value).startswith(message), str(err.value)


def test_a_set_and_a_map_in_families_of_their_own_validate():
    mapping_from_text(HEAD + """
families: {f: {}, g: {}, h: {}}
rules:
  - row_key: "{id}"
    columns:
      Tags: {family: f, as: set}
      Attrs: {family: g, as: map}
    other_attributes: {mode: column, family: h}
""")


# --- explain: every shape a user has at hand ---------------------------------------

from ddb2bt.pipeline.app.cli import main  # noqa: E402
from ddb2bt.transforms.inputs import ITEM, STREAM_RECORDS, parse_user_input  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

CATALOG = str(ROOT / "examples/product_catalog.yaml")
DIGITS36 = "123456789012345678901234567890123456"


@pytest.mark.parametrize("text,shape", [
    ('{"pk": {"S": "hats"}, "n": {"N": "%s"}}' % DIGITS36, "DynamoDB JSON item"),
    ('{"Item": {"pk": {"S": "hats"}, "n": {"N": "%s"}}}' % DIGITS36, '{"Item": …} (DynamoDB JSON)'),
    ('{"Item": {"pk": {"S": "hats"}, "n": {"N": "%s"}}, "ConsumedCapacity": {"TableName": "T"}}' % DIGITS36,
     '{"Item": …} (DynamoDB JSON)'),
    ('{"pk": "hats", "n": %s}' % DIGITS36, "plain JSON item"),
])
def test_every_item_shape_gives_the_same_exact_item(text, shape):
    given = parse_user_input(text)
    assert (given.kind, given.shape) == (ITEM, shape)
    assert given.item == {"pk": {"S": "hats"}, "n": {"N": DIGITS36}}


@pytest.mark.parametrize("token,n", [("3.14159265358979323846264338327950288", "3.14159265358979323846264338327950288"),
                                     ("1e-7", "0.0000001"), ("1.50", "1.5"), ("-0", "0"), ("1E+2", "100")])
def test_plain_json_numbers_are_exact_and_spelled_as_dynamodb_spells_them(token, n):
    assert parse_user_input('{"x": %s}' % token).item == {"x": {"N": n}}


@pytest.mark.parametrize("text,message", [
    ('{"x": 1%s}' % ("0" * 37 + "1"), "x: 39 significant digits; DynamoDB keeps at most 38"),
    ('{"x": 1e-131}', "x: magnitude out of DynamoDB's range"),
    ('{"x": {"N": "1e126"}}', "x: magnitude out of DynamoDB's range"),
    ('{"x": {"B": "not base64!"}}', "x: 'not base64!' is not valid base64"),
    ('{"Item": {"x": {"BS": ["AAE=", "%%%"]}}}', "Item.x[1]: '%%%' is not valid base64"),
    ('{"x": {"N": 30}}', "x: N must be a string of digits (DynamoDB JSON quotes numbers)"),
    ('{"x": {"SS": []}}', "x: an empty SS: DynamoDB does not allow empty sets"),
    ('{"x": {"NS": ["1", "1.0"]}}', "x: NS has duplicate members"),
    ('{"x": NaN}', "NaN is not a number DynamoDB can hold"),
    ('[1]', "expected a JSON object"),
])
def test_what_dynamodb_would_refuse_is_refused_with_the_reason_not_reread_as_plain_json(text, message):
    with pytest.raises(MappingError) as err:
        parse_user_input(text)
    assert err.value.message.startswith(message), err.value.message


def test_a_stream_record_as_json_arrives_in_boto3_form():
    given = parse_user_input('{"eventName": "INSERT", "dynamodb": {"ApproximateCreationDateTime": 1700000000.5, '
                             '"Keys": {"pk": {"S": "a"}}, "NewImage": {"pk": {"S": "a"}, "b": {"B": "AAE="}}, '
                             '"SequenceNumber": "42"}}')
    assert given.kind == STREAM_RECORDS and given.shape == "stream record"
    (raw,) = given.records
    assert raw["dynamodb"]["NewImage"]["b"] == {"B": b"\x00\x01"}
    assert raw["dynamodb"]["ApproximateCreationDateTime"].timestamp() == 1700000000.5
    iso = parse_user_input('{"eventName": "INSERT", "dynamodb": {"ApproximateCreationDateTime": '
                           '"2023-11-14T22:13:20Z", "Keys": {"pk": {"S": "a"}}}}')
    assert iso.records[0]["dynamodb"]["ApproximateCreationDateTime"].timestamp() == 1700000000


def test_explain_shows_a_get_item_output_with_a_36_digit_number_digit_for_digit(tmp_path, capsys):
    item = tmp_path / "item.json"
    item.write_text('{"Item": {"pk": {"S": "hats"}, "sk": {"S": "fedoras#brandA"}, "Weight": {"N": "%s"}}}'
                    % DIGITS36)
    assert main(["explain", "-m", CATALOG, "--item", str(item)]) == 0
    out = capsys.readouterr().out
    assert "table product_catalog row b'hats#fedoras#brandA'" in out
    assert f"set    SKU:Weight = b'{DIGITS36}' @1700000000000" in out


def test_explain_refuses_a_39_digit_plain_number_with_the_reason(tmp_path, capsys):
    item = tmp_path / "item.json"
    item.write_text('{"pk": "hats", "sk": "x", "Weight": 1%s}' % ("0" * 37 + "1"))
    assert main(["explain", "-m", CATALOG, "--item", str(item)]) == 1
    assert "Weight: 39 significant digits; DynamoDB keeps at most 38" in capsys.readouterr().err


def test_explain_a_stream_record_uses_its_event_and_time(tmp_path, capsys):
    record = tmp_path / "record.json"
    record.write_text('{"eventName": "REMOVE", "userIdentity": {"type": "Service", "principalId": '
                      '"dynamodb.amazonaws.com"}, "dynamodb": {"ApproximateCreationDateTime": 1700000001, '
                      '"Keys": {"pk": {"S": "hats"}, "sk": {"S": "x"}}, '
                      '"OldImage": {"pk": {"S": "hats"}, "sk": {"S": "x"}, "Price": {"N": "3"}}}}')
    assert main(["explain", "-m", CATALOG, "--item", str(record)]) == 0
    out = capsys.readouterr().out
    assert "== record 1: REMOVE at 1700000001000 ms" in out
    assert "delete SKU:Price in [0, 1700000001001) ms" in out


# --- dlq list shows keys and what to do; --mapping once --------------------------------

from types import SimpleNamespace  # noqa: E402

from ddb2bt.pipeline.control.state import StateStore  # noqa: E402
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable  # noqa: E402
from ddb2bt.transforms.model import DeadLetter, REMOVE, StreamPosition  # noqa: E402


def _letter(keys, reason="unknown_family"):
    record = ChangeRecord(REMOVE, keys, None, dict(keys, Secret={"S": "s3cr3t"}), 1_700_000_000_000,
                          position=StreamPosition("arn", "shard-1", "42"))
    return DeadLetter(reason, "MappingError", "family 'X' does not exist", "write", record, 1_700_000_000_500)


@pytest.mark.parametrize("include_values,show_keys,key_line", [
    (True, True, 'key pk="hats" sk="fedoras#brandA"'),
    (True, False, "key pk=<redacted: --show-keys> sk=<redacted: --show-keys>"),  # verify's policy too
    # Dataflow's default: no item values, but the keys, so a redrive finds the item
    (False, True, 'key pk="hats" sk="fedoras#brandA"'),
    (False, False, "key pk=<redacted: --show-keys> sk=<redacted: --show-keys>"),
])
def test_dlq_list_shows_each_letters_key_and_how_to_inspect_or_redrive_it(monkeypatch, capsys, include_values,
                                                                         show_keys, key_line):
    import ddb2bt.pipeline.services.dead_letters as dead_letters  # the dlq commands' service

    store = StateStore(InMemoryBigtable(), "job", lambda: 5, include_values)
    store.save_dead_letters([_letter({"pk": {"S": "hats"}, "sk": {"S": "fedoras#brandA"}})])
    monkeypatch.setattr(dead_letters, "state_spec", lambda *a, **k: SimpleNamespace(store=lambda: store))
    monkeypatch.setattr(dead_letters, "check_reachable", lambda *a, **k: None)  # the state is the fake above
    assert main(["dlq", "list", "-m", CATALOG, "--job-name", "shpo", "--state-table", "st2"]
                + (["--show-keys"] if show_keys else [])) == 0
    out = capsys.readouterr().out
    (letter_id,) = [e["id"] for e in store.list_dead_letters()]
    assert f"      {key_line}  id {letter_id}\n" in out
    # The hints repeat every option that selects the state: without --job-name they would show another job's.
    state = f"--mapping {CATALOG} --state-table st2 --job-name shpo"
    assert (f"inspect one: ddb2bt dlq show {state} ID    re-apply once the cause is fixed: "
            f"ddb2bt dlq redrive {state} [--reason R] [--dry-run]") in out
    assert "s3cr3t" not in out
    stored = store.list_dead_letters()[0]["record"]
    assert ("s3cr3t" in stored) is include_values, "without values, no image is stored"


def test_numeric_and_binary_keys_are_shown_as_digits_and_base64():
    from ddb2bt.pipeline.control.letters import key_text, record_to_json

    record = ChangeRecord(REMOVE, {"id": {"N": "12345678901234567890"}, "b": {"B": b"\x00\x01"}}, None, {}, 1)
    assert key_text(record_to_json(record)) == "b=AAE= id=12345678901234567890"


@pytest.mark.parametrize("argv,message", [
    (["validate", "-m", CATALOG, "-m", CATALOG], f"--mapping: named more than once: {CATALOG}"),
    (["explain", "-m", CATALOG, "-m", "example:videos", "--item", "-"], "'explain' takes one mapping, got 2"),
])
def test_a_repeated_mapping_is_an_error_naming_the_option(argv, message, capsys):
    """Several mappings make one job of several tables; the same file twice, or
    several where a command takes one, is refused naming the option."""
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# --- ION values DynamoDB never writes are refused, not guessed --------------------------

@pytest.mark.parametrize("ion,message", [
    ("{Item:{pk:\"a\",f:1.5e0}}", "f: Ion FLOAT is not a DynamoDB type"),
    ("{Item:{pk:\"a\",t:2023-11-14T22:13:20Z}}", "t: Ion TIMESTAMP is not a DynamoDB type"),
    ("{Item:{pk:\"a\",s:null.string}}", "s: Ion null.string is not a DynamoDB value"),
    ("{Item:{pk:\"a\",n:1d-131}}", "n: magnitude out of DynamoDB's range"),
    ("{Item:{pk:\"a\",ss:$dynamodb_SS::[\"x\",1]}}", "ss: a SS with a member that is not S"),
    ("{NotItem:{}}", "not an ION export item"),
])
def test_ion_values_dynamodb_never_writes_are_refused(ion, message):
    import io

    from ddb2bt.pipeline.source.exports import ion_items
    from ddb2bt.transforms.errors import PermanentError

    with pytest.raises(PermanentError) as err:
        list(ion_items(io.BytesIO(ion.encode()), "data/x.ion.gz"))
    assert message in str(err.value)
