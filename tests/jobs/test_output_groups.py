"""Output at scale: identical lines of many ranks print once with their rank range."""

from __future__ import annotations

import io
import re
import threading
from pathlib import Path

from monarch_cli.jobs.output import OutputSink
from monarch_cli.jobs.output_groups import LineGrouper, outcome_summary, rank_ranges
from monarch_cli.jobs.run_log import rank_log
from monarch_cli.jobs.spmd import RankExit

GROUP = re.compile(rb"^\[rank ([0-9,-]+)\] (.*)$")


def _ranks(spec: bytes) -> set[int]:
    out: set[int] = set()
    for part in spec.decode().split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def _sink(tmp_path: Path, n: int, **kw) -> tuple[OutputSink, io.BytesIO, io.BytesIO]:
    out, err = io.BytesIO(), io.BytesIO()
    sink = OutputSink(tmp_path, {r: f"rank{r}" for r in range(n)}, color=False, stdout=out, stderr=err, **kw)
    return sink, out, err


def test_rank_ranges() -> None:
    assert rank_ranges([3, 0, 1, 2, 5, 7, 8, 9]) == "0-3,5,7-9"
    assert rank_ranges([4]) == "4"
    assert rank_ranges([]) == ""


def test_many_ranks_print_a_shared_line_once_and_log_everything(tmp_path: Path) -> None:
    n = 256
    sink, out, _ = _sink(tmp_path, n)
    for epoch in range(3):
        for r in range(n):
            sink.write(r, 1, f"epoch {epoch} loss 2.31\n".encode())
    sink.write(17, 1, b"only me\n")
    for r in range(n):
        sink.end_of_rank(r)
    sink.close()
    lines = out.getvalue().splitlines()
    assert lines[:3] == [f"[rank 0-255] epoch {e} loss 2.31".encode() for e in range(3)]
    assert lines[3].startswith(b"[rank17]") and lines[3].endswith(b"only me")
    assert len(lines) == 4
    for r in (0, 17, 255):  # the logs keep every rank's every line
        log = rank_log(tmp_path, r).read_bytes()
        assert log.count(b"loss 2.31\n") == 3


def test_each_ranks_order_is_kept_when_ranks_interleave(tmp_path: Path) -> None:
    n = 40
    sink, out, _ = _sink(tmp_path, n)

    # Even ranks print A then B, odd ranks B then A, roughly in step (as ranks do), one rank
    # ahead of the others: no rank's order may be swapped.
    def lines(r: int) -> list[bytes]:
        first, second = (b"A\n", b"B\n") if r % 2 == 0 else (b"B\n", b"A\n")
        return [first, f"step {r % 3}\n".encode(), second]

    sink.write(7, 1, b"".join(lines(7)))
    for i in range(3):
        for r in range(n):
            if r != 7:
                sink.write(r, 1, lines(r)[i])
    sink.close()
    seen: dict[int, list[bytes]] = {r: [] for r in range(n)}
    for line in out.getvalue().splitlines():
        m = GROUP.match(line)
        if m:
            for r in _ranks(m.group(1)):
                seen[r].append(m.group(2))
        else:
            label, _, text = line.partition(b"] ")
            seen[int(label.strip(b"[rank "))].append(text.lstrip())
    for r in range(n):
        want = [b"A", f"step {r % 3}".encode(), b"B"] if r % 2 == 0 else [b"B", f"step {r % 3}".encode(), b"A"]
        assert seen[r] == want, r
    assert len(out.getvalue().splitlines()) <= 12  # and it did group


def test_streams_group_apart_and_ranks_filter(tmp_path: Path) -> None:
    sink, out, err = _sink(tmp_path, 64, console=set(range(0, 64, 2)), group=True)
    for r in range(64):
        sink.write(r, 1, b"hello\n")
        sink.write(r, 2, b"warn\n")
    sink.close()
    assert out.getvalue() == b"[rank " + rank_ranges(range(0, 64, 2)).encode() + b"] hello\n"
    assert err.getvalue() == b"[rank " + rank_ranges(range(0, 64, 2)).encode() + b"] warn\n"


def test_small_runs_print_as_before_and_grouping_can_be_turned_off(tmp_path: Path) -> None:
    for n, group in ((4, None), (64, False)):
        sink, out, _ = _sink(tmp_path / str(n), n, group=group)
        for r in range(n):
            sink.write(r, 1, b"same\n")
        sink.close()
        lines = out.getvalue().splitlines()
        assert len(lines) == n
        assert all(not GROUP.match(line) for line in lines)


def test_a_lone_line_is_printed_after_the_window_without_more_output(tmp_path: Path) -> None:
    printed = threading.Event()
    got: list[bytes] = []

    def write(stream: int, data: bytes) -> None:
        got.append(data)
        printed.set()

    grouper = LineGrouper(write, {0: b"[rank0] ", 1: b"[rank1] "}, [0, 1], window=0.05)
    grouper.add(0, 1, [b"waiting\n"])
    assert printed.wait(10), "a line nobody else printed must not wait for more output"
    assert got == [b"[rank0] waiting\n"]
    grouper.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_line_thousands_of_ranks_print_at_once_prints_once_however_long_it_takes_to_arrive() -> None:
    """32,768 ranks' line reaches the client over ~2 s (it reads ~15-20 k ranks' events a
    second): a burst, not a trickle, so it waits past MAX_HOLD while copies keep arriving fast,
    and prints once. A slow trickle still prints at MAX_HOLD."""
    n = 5000
    got: list[bytes] = []
    clock = _Clock()
    grouper = LineGrouper(lambda _s, data: got.append(data), {}, range(n), clock=clock)
    for r in range(n):  # 2,000 ranks a second: 2.5 s in all, past MAX_HOLD
        clock.now += 0.0005
        grouper.add(r, 1, [b"epoch 3 loss 2.31\n"])
    assert got == [f"[rank 0-{n - 1}] epoch 3 loss 2.31\n".encode()]
    got.clear()
    trickle = LineGrouper(lambda _s, data: got.append(data), {}, range(n), clock=clock)
    for r in range(30):  # 10 ranks a second for 3 s, each within the window of the last
        clock.now += 0.1
        trickle.add(r, 1, [b"loading\n"])
    assert len(got) == 1, got  # at MAX_HOLD (2 s), not held while the rest trickle in
    first = GROUP.match(got[0])
    assert first is not None and 19 <= len(_ranks(first.group(1))) <= 22, got
    grouper.close()
    trickle.close()


def test_outcome_summary_groups_ranks_by_how_they_ended() -> None:
    exits = [RankExit(r, f"rank{r}", "h", 0, None, 1.0) for r in range(4096)]
    exits[17] = RankExit(17, "rank17", "h", None, 11, 1.0)
    exits[802] = RankExit(802, "rank802", "h", None, 11, 1.0)
    assert outcome_summary(exits) == "4,094 exited 0; ranks 17, 802: killed by SIGSEGV"
    exits = [RankExit(r, f"rank{r}", "h", 1 if r < 10 else 0, None, 1.0) for r in range(20)]
    assert outcome_summary(exits) == "10 exited 0; 10 ranks: exit 1"


def test_ranks_that_ended_do_not_complete_a_group_the_running_ranks_have_not_joined(tmp_path: Path) -> None:
    """Each host's output and exits arrive together (batched): half the ranks print a line and
    end before the other half print it. The line still prints once, with every rank: a group is
    complete when every running rank has joined it, not when it has as many ranks as are running."""
    n = 64
    sink, out, _ = _sink(tmp_path, n)
    for r in range(n):
        sink.write(r, 1, b"epoch 3 loss 2.31\n")
        sink.end_of_rank(r)
    sink.close()
    assert out.getvalue().splitlines() == [b"[rank 0-63] epoch 3 loss 2.31"]
