"""The named queries behind every view, and the key=value numbers the plots take from output lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from monarch_cli.telemetry import QUERIES, TelemetryWriter, db_path, numbers, rows


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("step=3 loss=0.25 lr=3e-4", [("step", 3.0), ("loss", 0.25), ("lr", 3e-4)]),
        ("epoch 1: train/loss=1.5, acc=97.5%", [("train/loss", 1.5), ("acc", 97.5)]),
        ("grad_norm= -2.", [("grad_norm", -2.0)]),
        ("version=1.2.3 path=/tmp/x=1 name=abc", []),
        ("no numbers here", []),
        ("a==1", []),
    ],
)
def test_numbers_in_a_line(line: str, found: list[tuple[str, float]]) -> None:
    assert numbers(line) == found


def test_every_named_query_runs_on_a_real_store(tmp_path: Path) -> None:
    """Each statement is valid SQL for the store's schema (run with NULLs/zeros for its parameters)."""
    w = TelemetryWriter(db_path(tmp_path), "r1")
    w.sql("INSERT INTO runs (run_id, command, started_at) VALUES (?, ?, ?)", ("r1", "python t.py", 1.0))
    w.output(0, 1, b"step=1 loss=2\n")
    w.close()
    for name, (_, sql) in QUERIES.items():
        params = [0] * sql.count("?")
        rows(db_path(tmp_path), name, params)
    assert rows(db_path(tmp_path), "latest_run")[0]["run_id"] == "r1"
    assert [r["line"] for r in rows(db_path(tmp_path), "numbers_after", ("r1", 0, 100))] == ["step=1 loss=2"]
