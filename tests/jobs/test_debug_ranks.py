"""The RANKS forms of `monarch debug cast/continue`, on 8 paused ranks of 2 hosts x 4 gpus."""

from __future__ import annotations

import pytest

from monarch_cli.jobs import JobError
from monarch_cli.jobs.debug import PausedRank, select_ranks

ROWS: list[PausedRank] = [
    PausedRank(
        "run",
        r,
        f"host{r // 4}",
        "tcp://x",
        None,
        "paused",
        "t.py",
        1,
        "<module>",
        "breakpoint",
        None,
        None,
        {"hosts": r // 4, "gpus": r % 4},
    )
    for r in range(8)
]


@pytest.mark.parametrize(
    "expr, ranks",
    [
        ("*", set(range(8))),
        ("all", set(range(8))),
        ("3", {3}),
        ("0,3", {0, 3}),
        ("2-5", {2, 3, 4, 5}),
        ("0:8:2", {0, 2, 4, 6}),
        ("6:", {6, 7}),
        ("0,2-3,7", {0, 2, 3, 7}),
        ("hosts=1", {4, 5, 6, 7}),
        ("gpus=0", {0, 4}),
        ("hosts=1,gpus=0:2", {4, 5}),
    ],
)
def test_rank_forms(expr: str, ranks: set[int]) -> None:
    assert select_ranks(expr, ROWS) == ranks


@pytest.mark.parametrize("expr", ["x", "1-", "a:b", "hosts=z"])
def test_unreadable_rank_forms_are_one_clear_error(expr: str) -> None:
    with pytest.raises(JobError, match=r"cannot read ranks .*: use \*, 0,3, 2-5, 0:8:2 or hosts=1,gpus=0:2"):
        select_ranks(expr, ROWS)
