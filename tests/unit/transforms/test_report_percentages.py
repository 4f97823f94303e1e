"""The draft report's shares read as a person writes them."""
from __future__ import annotations

from ddb2bt.transforms.draft import percent_text


def test_percentages_are_written_out_never_in_exponent_form():
    assert [percent_text(p) for p in (100.0, 99.6, 20.0, 12.34, 2.5, 0.05, 0.001, 150.0, 1234.0)] == \
        ["100%", "100%", "20%", "12%", "2.5%", "0.05%", "under 0.01%", "150%", "1,234%"]
