"""The demo's row read back shows each value as a person reads it."""
from __future__ import annotations

from decimal import Decimal

from ddb2bt.pipeline.app.demo import shown_value


def test_values_read_back_are_shown_decoded_not_as_python_reprs():
    assert shown_value({"N": "90844"}) == "90844"
    assert shown_value(b"1.4") == "1.4"  # encoding auto: a scalar's own text
    assert shown_value({"S": "Bicycle 2"}) == '"Bicycle 2"'
    assert shown_value(b"\xff\x00") == "0xff00"
    assert shown_value({"SS": ["a", "b"]}) == '{"SS": ["a", "b"]}'
    assert shown_value(Decimal("3.5")) == "3.5" and shown_value(True) == "true"
    assert "{'" not in shown_value({"M": {"a": {"N": "1"}}}) and "b'" not in shown_value(b"x")
