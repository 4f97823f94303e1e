"""`ddb2bt draft`, the pure part (transforms/draft.py) and the bounded sample
(pipeline/services/draft.py) against a large fake table: the delimiter, order-preserving
numeric sort keys, entity types, the sample's bounds (N items, --max-rcu), split
points, and the refusals (no permission)."""
from __future__ import annotations

import threading

import pytest
from botocore.exceptions import ClientError

from ddb2bt.pipeline.services import draft as draft_io
from ddb2bt.pipeline.app.cli import main
from ddb2bt.pipeline.services.draft import DraftRefused, SampleBounds, read_table_facts, sample_table
from ddb2bt.transforms.draft import (DELIMITER_CANDIDATES, SORT_KEY_PAD, draft_mapping, split_points, table_facts,
                                     type_prefix)
from ddb2bt.transforms.lint import WARN, lint
from ddb2bt.transforms.mapping import expected_cells
from tests.unit.transforms.draft_tables import NOW_S, SourceTable, all_tables, product_catalog
from tests.unit.transforms.test_examples import item


def drafted(source: SourceTable):
    facts = table_facts(source.describe(source.label), None, None)
    return draft_mapping(facts, source.items, project="p", instance="i", now_s=NOW_S)


def row_keys(draft, items):
    mapping = draft.mapping()
    return [next(c.row_key for c in expected_cells(mapping, it).values() if c.table == mapping.target.table)
            for it in items]


def test_partition_keys_holding_the_delimiter_get_another_one_sort_keys_holding_it_keep_pk_sk():
    sort_holds_it = product_catalog()  # sk fedoras#brandA: the last part may hold '#'
    d = drafted(sort_holds_it)
    assert d.delimiter == "#" and d.data["rules"][0]["row_key"] == "{pk}#{sk}"
    assert row_keys(d, sort_holds_it.items[:1]) == [b"hats#fedoras#brandA"]  # the seed's own key

    items = [item(pk=f"tenant#{i}", sk=f"doc#{i}", Body=f"text {i}") for i in range(20)]
    d = drafted(SourceTable("Docs", "pk", "sk", items))
    assert d.delimiter == ":" and d.data["rules"][0]["row_key"] == "{pk}:{sk}"
    assert row_keys(d, items[:1]) == [b"tenant#0:doc#0"]  # readable: no escapes needed
    assert any("delimiter ':'" in g for g in d.guesses)

    every = [item(pk=f"a{c}{i}", sk="x", Body="b") for i, c in enumerate(DELIMITER_CANDIDATES * 2)]
    d = drafted(SourceTable("Odd", "pk", "sk", every))
    assert d.delimiter == "#" and any("escaped" in g for g in d.guesses)  # the engine escapes: still injective
    keys = row_keys(d, every)
    assert len(set(keys)) == len(every)


def test_a_numeric_sort_key_gets_an_order_preserving_key():
    items = [item(device=f"d{i % 3}", seq=n, Reading=n * 2) for i, n in enumerate([3, 20, 100, 7, 65, 1000, 9])]
    source = SourceTable("Readings", "device", "seq", items, key_types={"seq": "N"})
    d = drafted(source)
    assert d.data["rules"][0]["row_key"] == f"{{device}}#{{seq|pad:{SORT_KEY_PAD}}}"
    by_key = sorted(zip(row_keys(d, items), items))
    for device in ("d0", "d1", "d2"):
        seqs = [int(it["seq"]["N"]) for key, it in by_key if it["device"]["S"] == device]
        assert seqs == sorted(seqs)  # lexicographic row order is numeric order

    fractional = [item(device="d", seq=n, Reading=1) for n in ("-1.5", "2", "10")]
    d = drafted(SourceTable("Signed", "device", "seq", fractional, key_types={"seq": "N"}))
    assert d.data["rules"][0]["row_key"] == "{device}#{seq}"
    assert any("negative or fractional" in x for x in d.decisions)  # said, not hidden


def test_an_integer_partition_key_is_reversed_and_a_date_partition_key_salted():
    ids = [item(id=n, v="x") for n in range(1000, 1040)]
    d = drafted(SourceTable("Seq", "id", None, ids, key_types={"id": "N"}))
    assert d.data["rules"][0]["row_key"] == "{id|reverse}"
    days = [item(day=f"2023-09-{10 + i}", v="x") for i in range(20)]
    d = drafted(SourceTable("Days", "day", None, days))
    assert d.data["rules"][0]["row_key"] == "{day|salt:16}#{day}"
    assert not [f for f in lint(d.mapping(), days) if f.level == WARN]


def test_entity_types_come_from_key_prefixes_and_encodings_from_the_sampled_types():
    source = next(t for t in all_tables() if t.label == "SingleTable")
    d = drafted(source)
    rules = {r["name"]: r for r in d.data["rules"]}
    assert rules["cust"]["match"] == {"attribute": "SK", "prefix": "CUST#"}
    assert rules["order"]["match"] == {"attribute": "SK", "prefix": "ORDER#"}
    assert "match" not in d.data["rules"][-1]  # the last rule takes the types the sample did not see
    cust, order = rules["cust"]["columns"], rules["order"]["columns"]
    assert cust["Balance"]["encoding"] == "decimal"  # 38 digits: exact, never int64 or float
    assert cust["ExpiresAt"]["encoding"] == "int64"
    # one data family with the attributes' names as qualifiers: a set or a map is one cell, not a family
    assert cust["Tags"] == {"column": "d:Tags", "encoding": "json"}
    assert cust["Address"] == {"column": "d:Address", "encoding": "json"}
    assert set(d.data["families"]) <= {"d", "idx"}
    assert order["Lines"]["encoding"] == "json"  # a list: one serialized cell
    assert order["Amount"]["encoding"] == "decimal"
    one = drafted(product_catalog())  # the same attributes under every sk prefix: categories, one rule
    assert len(one.data["rules"]) == 1 and "match" not in one.data["rules"][0]
    assert type_prefix("HR-EMPLOYEE#0001") == "HR-EMPLOYEE#" and type_prefix("Invoice-0123") == "Invoice-"
    assert type_prefix("2023-09-10") is None and type_prefix("0123") is None


def test_every_shipped_table_drafts_a_mapping_that_validates_and_lints_clean():
    for source in all_tables():
        d = drafted(source)
        mapping = d.mapping()  # parse_mapping: what validate runs
        assert not [f for f in lint(mapping, source.items) if f.level == WARN], source.label
        assert d.text.startswith("# Drafted by `ddb2bt draft")


def test_split_points_are_quantiles_of_the_sampled_row_keys():
    items = [item(pk=f"user{i:04d}", sk="profile", v="x") for i in range(500)]
    d = drafted(SourceTable("Users", "pk", "sk", items))
    points = split_points(d.mapping(), items)
    assert len(points) == 50 and points == sorted(points)  # 10 sampled keys per range, at most 100
    keys = sorted(row_keys(d, items))
    ranges = [sum(1 for k in keys if lo <= k < hi) for lo, hi in zip([b""] + points, points + [b"\xff"])]
    assert max(ranges) - min(ranges) <= 1  # even ranges
    assert split_points(d.mapping(), items[:9]) == []  # too few keys to say anything


class LargeFakeTable:
    """A DynamoDB client over a table of ``size`` items made on demand, per
    Scan segment, reporting consumed capacity like the service (0.5 RCU per
    4 KB, eventually consistent)."""

    def __init__(self, size: int, item_bytes: int = 4096) -> None:
        self.size, self.item_bytes = size, item_bytes
        self.served = 0
        self.largest_page = 0
        self.lock = threading.Lock()

    def scan(self, TableName, ConsistentRead, ReturnConsumedCapacity, Segment=0, TotalSegments=1, Limit=1000,
             ExclusiveStartKey=None):
        per_segment = self.size // TotalSegments
        start = int(ExclusiveStartKey["pk"]["S"]) + 1 if ExclusiveStartKey else Segment * per_segment
        end = min((Segment + 1) * per_segment, start + Limit)
        page = [{"pk": {"S": str(n)}, "body": {"S": "x" * self.item_bytes}} for n in range(start, end)]
        with self.lock:
            self.served += len(page)
            self.largest_page = max(self.largest_page, len(page))
        out = {"Items": page, "ConsumedCapacity": {"CapacityUnits": 0.5 * len(page) * self.item_bytes / 4096}}
        if end < (Segment + 1) * per_segment:
            out["LastEvaluatedKey"] = {"pk": {"S": str(end - 1)}}
        return out


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


def test_the_sample_stops_at_n_items_and_honours_the_read_budget():
    table = LargeFakeTable(1_000_000)
    clock = FakeClock()
    items, sample = sample_table(table, "Big", SampleBounds(items=2000, max_rcu=200.0, segments=8),
                                 clock=clock, sleep=clock.sleep)
    assert len(items) == 2000 and sample.stopped == "limit"
    assert sample.read == 20_000  # ten times what it keeps, drawn from all of it
    assert table.served - sample.read < 8 * 10  # no page read far past the budget
    assert table.largest_page <= 1000  # pages of at most the Scan page limit
    assert 10_000.0 <= sample.consumed_rcu < 10_040.0
    # The budget: what was read is at most a second's burst plus max_rcu per second that passed.
    assert sample.consumed_rcu <= 200.0 * (clock.now + 1) + 0.5 * 1000
    assert clock.now >= sample.consumed_rcu / 200.0 - 1 - 1000 * 0.5 / 200.0  # it really waited


def test_the_sample_gives_up_at_its_deadline_with_what_it_has():
    table = LargeFakeTable(1_000_000, item_bytes=40_000)
    clock = FakeClock()
    items, sample = sample_table(table, "Big", SampleBounds(items=100_000, max_rcu=100.0, segments=2,
                                                            deadline_s=30.0), clock=clock, sleep=clock.sleep)
    assert sample.stopped == "deadline" and 0 < len(items) < 100_000


class DeniedClient:
    def describe_table(self, TableName):
        raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "not authorized"},
                           "ResponseMetadata": {"HTTPStatusCode": 400}}, "DescribeTable")


def test_no_permission_is_a_clear_error_and_exit_1(monkeypatch, capsys):
    with pytest.raises(DraftRefused, match="dynamodb:DescribeTable and dynamodb:Scan"):
        read_table_facts(DeniedClient(), "Orders")
    monkeypatch.setattr("ddb2bt.pipeline.services.mappings.dynamodb_client", lambda region=None: DeniedClient())
    assert main(["draft", "--table", "Orders"]) == 1
    err = capsys.readouterr().err
    assert "DescribeTable on DynamoDB table 'Orders' was refused (no permission)" in err


def test_the_cli_passes_the_sample_bounds(monkeypatch, capsys, tmp_path):
    source = product_catalog()
    seen = []

    class Described:
        def describe_table(self, TableName):
            return {"Table": source.describe(TableName)}

        def describe_time_to_live(self, TableName):
            return {"TimeToLiveDescription": {"TimeToLiveStatus": "DISABLED"}}

        def describe_continuous_backups(self, TableName):
            return {"ContinuousBackupsDescription": {"PointInTimeRecoveryDescription": {
                "PointInTimeRecoveryStatus": "ENABLED"}}}

    def sample(client, table, bounds, keys=()):
        seen.append(bounds)
        return source.items, draft_io.SampleFacts(len(source.items), 1, 3.0, "end", 1, 0.1)

    monkeypatch.setattr("ddb2bt.pipeline.services.mappings.dynamodb_client", lambda region=None: Described())
    monkeypatch.setattr(draft_io, "sample_table", sample)
    out = tmp_path / "m.yaml"
    assert main(["draft", "--table", "ProductCatalog", "--sample", "300", "--max-rcu", "25", "--out", str(out)]) == 0
    assert seen == [SampleBounds(items=300, max_rcu=25.0)]
    report = capsys.readouterr().out
    assert "point-in-time recovery: ENABLED" in report and "sizing:" in report and "backfill:" in report
    assert main(["validate", "-m", str(out), "--strict"]) == 0


def test_draft_and_the_split_option_teach_in_their_help(capsys):
    for command in (["draft"], ["create-table"]):
        with pytest.raises(SystemExit) as exit_:
            main(command + ["--help"])
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "ddb2bt draft --table Orders --out orders.yaml" in out and "--max-rcu" in out
    assert "--split-from-sample" in out and "quantiles of the row keys" in out


def test_the_assessment_sizes_the_target_and_shows_no_item_values():
    from ddb2bt.transforms.draft import SampleFacts, assess

    source = product_catalog()
    facts = table_facts(source.describe(source.label, item_count=2_000_000_000), None, None)
    d = draft_mapping(facts, source.items, project="p", instance="i", now_s=NOW_S)
    mapping = d.mapping()
    report = assess(facts, SampleFacts(len(source.items), 1, 3.0, "limit", 8, 1.0), source.items, mapping,
                    lint(mapping, source.items), len(split_points(mapping, source.items))).render()
    # 2e9 items at half the measured 14,471 items/s per vCPU: 76.8 vCPU-hours, 3 workers of 4 vCPUs
    # within 8 hours; 69,445 rows/s over 8 hours needs 7 SSD nodes at 10,000 writes/s each.
    assert "76.78 vCPU-hours at 7,236 items/s per vCPU" in report and "3 Dataflow worker(s) of 4 vCPUs" in report
    assert "7 for the backfill's ~69,445 rows/s over 8 h" in report
    assert "item size (sampled, DynamoDB's rules): p50" in report and "point-in-time recovery: unknown" in report
    for it in source.items:  # names and counts only: never an item's contents
        assert it["Description"]["S"] not in report and it["pk"]["S"] + "#" not in report


def test_an_lsi_becomes_index_rows_keyed_by_the_partition_then_its_sort_key():
    items = [item(pk=f"u{i % 4}", sk=f"msg{i}", SentAt=f"2023-09-{10 + i}", Body="hi") for i in range(12)]
    source = SourceTable("Messages", "pk", "sk", items)
    describe = source.describe("Messages")
    describe["AttributeDefinitions"].append({"AttributeName": "SentAt", "AttributeType": "S"})
    describe["LocalSecondaryIndexes"] = [{"IndexName": "BySentAt", "KeySchema": [
        {"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "SentAt", "KeyType": "RANGE"}],
        "Projection": {"ProjectionType": "INCLUDE", "NonKeyAttributes": ["Body"]}}]
    d = draft_mapping(table_facts(describe), items, project="p", instance="i", now_s=NOW_S)
    (index,) = d.data["rules"][0]["indexes"]
    assert index == {"name": "bysentat", "row_key": "idx#bysentat#{pk}#{SentAt}#{sk}", "family": "idx",
                     "project": ["Body"]}
    mapping = d.mapping()
    rows = sorted(c.row_key for it in items for c in expected_cells(mapping, it).values()
                  if c.row_key.startswith(b"idx#"))
    assert rows[0] == b"idx#bysentat#u0#2023-09-10#msg0"  # a partition's rows by SentAt: one prefix read
