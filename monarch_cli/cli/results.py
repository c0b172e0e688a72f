"""The objects ``--json`` prints, built once for the CLI and the MCP server (``monarch_cli/mcp``).

A command that had built its JSON inline calls these instead, so an agent driving the MCP
server gets exactly what ``monarch CMD --json`` prints. Standard library only at import time:
``monarch logs`` must not load the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UserError
from ..jobs.output import list_runs
from ..jobs.run_log import rank_logs
from ..jobs.state import state_path

if TYPE_CHECKING:
    from ..jobs import Job
    from ..jobs.debug import PausedRank


def logs_root(state: Path | str | None, job_id: str | None = None) -> Path:
    """Where a reservation's (or a ``monarch sbatch`` job's) run logs are."""
    if job_id is not None:
        from ..jobs.slurm_batch import batch_dir

        return batch_dir(job_id, state) / "logs"
    return state_path(state).parent / "logs"


def run_logs(root: Path, run: str | None, rank: int | None) -> tuple[Path, list[Path]]:
    """The run's directory (default: the latest) and its rank logs (only ``rank``'s if given), by rank."""
    runs = list_runs(root)
    if not runs:
        raise UserError(f"no runs logged under {root}")
    if run is not None and (not run or "/" in run or run.startswith(".")):
        raise UserError(f"not a run id: {run!r}")
    run_dir = (root / run) if run else runs[-1]
    if not run_dir.is_dir():
        raise UserError(f"no run {run!r} under {root}; latest runs: {', '.join(p.name for p in runs[-5:])}")
    # The rank files are made from the run's log when first asked for (beside it, or in a private
    # copy where the run directory cannot be written).
    files = rank_logs(run_dir)
    if rank is not None:
        files = [f for f in files if f.stem == f"rank{rank}"]
        if not files:
            raise UserError(f"run {run_dir.name} has no rank {rank}")
    return run_dir, files


def logs_json(run_dir: Path, files: list[Path]) -> dict[str, Any]:
    """``monarch logs --json``: the log files and the run's result (None while it runs; ``ended``
    says why a run without one has ended: its client died, or it failed to run)."""
    result = run_dir / "result.json"
    return {
        "run_id": run_dir.name,
        "logs": {f.stem: str(f) for f in files},
        "result": json.loads(result.read_text()) if result.exists() else None,
        "ended": ended_without_result(run_dir),
    }


def ended_without_result(run_dir: Path) -> str | None:
    """Why a run with no result has ended (its client died: it is marked lost from now on; or it
    failed to run), else None (it goes on, it has its result, or an older client ran it)."""
    from ..jobs import run_owner

    owner = run_owner.settle(run_dir, run_dir.parent.parent)  # <state dir>/logs/<run id>
    if owner is None or owner.get("state") not in (run_owner.LOST, run_owner.FAILED):
        return None
    return str(owner["error"]) if owner["state"] == run_owner.LOST else f"run {run_dir.name}: {owner['error']}"


def warm_json(job: Job) -> dict[str, Any]:
    """``monarch warm --json``: each host's warm process."""
    return {"hosts": [{"name": h["name"], "alive": h["alive"], "warm": h["warm"]} for h in job.status()["hosts"]]}


def stopped_json(rid: str, ended: list[str]) -> dict[str, Any]:
    """``monarch stop --json`` after a release (``runs_ended``: the runs that were in progress)."""
    return {"stopped": rid, "runs_ended": ended}


NOTHING_TO_STOP: dict[str, Any] = {"stopped": None, "message": "nothing to stop"}


def no_reservation_json(message: str) -> dict[str, Any]:
    """``monarch status --json`` where nothing is served."""
    return {"reservation": None, "message": message}


def paused_json(rows: list[PausedRank]) -> list[dict[str, Any]]:
    """``monarch debug list --json``."""
    return [r.to_json() for r in rows]


def paused_summary(rows: list[PausedRank]) -> str:
    """How many ranks wait in pdb; ranks that already finished are listed too (to inspect), but
    are not paused."""
    paused = sum(r.state == "paused" for r in rows)
    others = [f"{n} {state}" for state in ("running", "exited") if (n := sum(r.state == state for r in rows))]
    return ", ".join([f"{paused} rank(s) paused" if paused else "no rank is paused yet", *others])


def cast_json(results: dict[int, Any]) -> dict[str, Any]:
    """``monarch debug cast --json``: per rank, its pdb output or ``{"error"}``."""
    return {str(r): ({"error": str(v)} if isinstance(v, Exception) else v) for r, v in results.items()}


def top_json(run_id: str | None, rows: list[Any]) -> dict[str, Any]:
    """``monarch top --json``."""
    return {"run_id": run_id, "ranks": [r.__dict__ for r in rows]}
