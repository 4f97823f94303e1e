"""`validate` and `explain --reverse` say, rule by rule, what a rollback writes back."""
import io
import json

from ddb2bt.pipeline.app.cli import main as ddb2bt


def test_explain_reverse_and_validate_say_what_inverts(capsys, monkeypatch):
    assert ddb2bt(["validate", "--mapping", "example:invoices"]) == 0
    out = capsys.readouterr().out
    assert "rollback: rule payment: inverts" in out
    assert "rollback: rule invoice: inverts for items DynamoDB holds" in out
    payment = {"pk": "Invoice-0123", "sk": "Payment-0680", "DateCreated": "2023-09-10T15:21:40",
               "Details": {"amount_usd": 120}}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(payment)))
    assert ddb2bt(["explain", "--mapping", "example:invoices", "--reverse", "--item", "-"]) == 0
    out = capsys.readouterr().out
    assert "key sk: from its regex 'Payment-(?P<payment>.+)' and the captures" in out
    assert "rule payment: " in out and "(the same item)" in out
    invoice = dict(payment, sk="Invoice-0123")
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(invoice)))
    assert ddb2bt(["explain", "--mapping", "example:invoices", "--reverse", "--item", "-"]) == 0
    out = capsys.readouterr().out
    assert "not written back: Invoice:Details: no item of an invertible rule reads back to this cell" in out


def test_explain_without_item_or_reverse_names_the_missing_option(capsys):
    assert ddb2bt(["explain", "--mapping", "example:invoices"]) == 2
    assert "--item" in capsys.readouterr().err


def test_the_rollback_commands_are_on_the_face(capsys):
    for command in ("prepare", "run", "status", "verify"):
        try:
            ddb2bt(["rollback", command, "--help"])
        except SystemExit as exc:
            assert exc.code == 0
        assert "--mapping" in capsys.readouterr().out
