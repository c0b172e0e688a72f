"""Jobs: reservations recorded in a state file, and SPMD runs on them."""

from .errors import JobError
from .job import Job, clear_unreadable, dryrun, job_load, serve
from .spmd import RankExit, RunResult, StaleReservation

__all__ = ["Job", "JobError", "RankExit", "RunResult", "StaleReservation", "clear_unreadable", "dryrun", "job_load", "serve"]
