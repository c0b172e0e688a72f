"""What keeps an agent's context small (mcp/bounds.py): clipped lines, tails read from the
end of big logs, greps that count what they left out, capped lists that say so."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from monarch_cli.mcp.bounds import MAX_LINE, cap, clip_line, scan, tail_lines


def test_a_tail_is_read_from_the_end_and_long_lines_are_clipped(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    with open(log, "w") as f:
        for i in range(200_000):  # ~3 MB: more than one block from the end
            f.write(f"line {i}\n")
        f.write("x" * 5000 + "\n")
        f.write("caf\xe9 last\n")
    lines = tail_lines(log, 3)
    assert lines[0] == "line 199999"
    assert lines[1].startswith("x" * MAX_LINE) and lines[1].endswith(f"[{5000 - MAX_LINE} more characters]")
    assert lines[2] == "café last"
    assert len(tail_lines(log, 70_000)) == 70_000 and tail_lines(log, 0) == []
    assert clip_line("short") == "short"


def test_grep_keeps_the_last_matches_with_their_line_numbers_and_counts(tmp_path: Path) -> None:
    log = tmp_path / "rank1.log"
    log.write_bytes(b"".join(b"step %d loss %d\n" % (i, i % 3) for i in range(100)) + b"\xff bad utf-8\n")
    kept, matched, total = scan(log, re.compile(r"loss 0$"), 2)
    assert matched == 34 and total == 101
    assert kept == [{"n": 97, "line": "step 96 loss 0"}, {"n": 100, "line": "step 99 loss 0"}]
    kept, matched, total = scan(log, None, 1)
    assert kept == [{"n": 101, "line": "\\xff bad utf-8"}] and matched == total == 101


def test_a_capped_list_says_how_many_were_left_out_and_where_they_are() -> None:
    data = {"ranks": list(range(10)), "other": [1]}
    cap(data, "ranks", 4, "sql over ranks")
    cap(data, "other", 4, "never")
    assert data == {"ranks": [0, 1, 2, 3], "ranks_left_out": 6, "ranks_hint": "sql over ranks", "other": [1]}


def test_a_log_line_of_tens_of_megabytes_without_a_newline_is_read_once(tmp_path: Path) -> None:
    """A tqdm bar redrawn with \\r and never ended is one line of many MB: the tail shows its
    last lines clipped, a grep counts every line right and matches long lines on their head."""
    from monarch_cli.mcp.bounds import MAX_TAIL_BYTES

    log = tmp_path / "rank0.log"
    log.write_bytes(b"start\n" + b"step 1\n" + b"y" * (MAX_TAIL_BYTES + (1 << 20)) + b"\nend of run\n")
    last = tail_lines(log, 2)
    assert last[-1] == "end of run" and last[0].startswith("y" * 400) and "more characters" in last[0]
    found, matched, total = scan(log, re.compile(r"^(step|end)"), 10)
    assert (matched, total) == (2, 4) and [f["n"] for f in found] == [2, 4]


@pytest.mark.slow
def test_a_backtracking_grep_is_stopped_and_the_server_serves_the_next_call(tmp_path: Path) -> None:
    """`(a+)+$` on a long line of `a`s backtracks for ever: the server stopped answering (re held
    the GIL). Now the call is an error within seconds, and the next call is answered."""
    import time

    import anyio

    from .test_mcp import connected

    run_dir = tmp_path / ".monarch" / "logs" / "20261127-120000000-abcd"
    run_dir.mkdir(parents=True)
    (run_dir / "rank0.log").write_text("start\n" + "a" * 30_000 + "!\n" + "end of run\n")

    async def session() -> tuple[float, str, dict[str, Any]]:
        async with connected(tmp_path, tmp_path / "server.log") as agent:
            started = time.monotonic()
            said = await agent.refused("logs", {"grep": "(a+)+$"})
            took = time.monotonic() - started
            return took, said, await agent.ok("logs", {"grep": "^end"})

    took, said, found = anyio.run(session)
    assert took < 15 and "was stopped" in said and "simplify the pattern" in said, (took, said)
    assert found["ranks"][0]["lines"] == [{"n": 3, "line": "end of run"}], found
