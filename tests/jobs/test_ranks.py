"""One rank-list syntax for `run-spmd --ranks` and `monarch debug`."""

from __future__ import annotations

import pytest

from monarch_cli.jobs import JobError
from monarch_cli.jobs.ranks import parse_rank_list


@pytest.mark.parametrize(
    "text, size, ranks",
    [
        ("0,2-3", None, {0, 2, 3}),
        ("0:8:2", None, {0, 2, 4, 6}),
        ("5", None, {5}),
        ("4:", 8, {4, 5, 6, 7}),
        ("::3", 8, {0, 3, 6}),
    ],
)
def test_forms(text: str, size: int, ranks: set) -> None:
    assert parse_rank_list(text, size) == ranks


@pytest.mark.parametrize("text", ["x", "4:", "1-", "-1", "0:8:2:1"])
def test_bad_lists_name_the_option_and_the_syntax(text: str) -> None:
    with pytest.raises(JobError, match=r"--ranks takes numbers, ranges and slices such as 0,3 or 2-5 or 0:8:2"):
        parse_rank_list(text, None, "--ranks")
