"""The sample row key format lives in one helper, and every reader of keys goes through it."""

from __future__ import annotations

import pytest

from relax_services.rows import prompt_key_of, sample_key, split_sample_key
from relax_services.services.trainer import sample_order


def test_sample_keys_round_trip_and_sort_by_prompt_then_index() -> None:
    assert sample_key("p0000012", 3) == "p0000012/3"
    assert split_sample_key("p0000012/3") == ("p0000012", 3)
    # a prompt key that itself holds a slash keeps it: only the last part is the index
    assert split_sample_key(sample_key("task/a", 10)) == ("task/a", 10)
    keys = ["p1/10", "p0/2", "p1/9", "p0/0"]
    assert sorted(keys, key=sample_order) == ["p0/0", "p0/2", "p1/9", "p1/10"]  # numeric, not text, order


def test_prompt_key_of_takes_sample_and_prompt_row_keys() -> None:
    assert prompt_key_of("p0000007/5") == "p0000007"
    assert prompt_key_of("p0000007") == "p0000007"  # a prompt row's own key


@pytest.mark.parametrize("bad", ["p1", "p1/", "/3", "p1/x"])
def test_malformed_sample_keys_are_named(bad: str) -> None:
    with pytest.raises(ValueError, match=r"sample row key .* is not '<prompt key>/<index>'"):
        split_sample_key(bad)
