"""The Slurm backend: ``scheduler`` (the client side), ``commands`` (Slurm's CLI tools),
``node`` (what runs on every node of the job: it becomes the node's host agent)."""

from .commands import SlurmError
from .scheduler import OPTION_FLAGS, OPTIONS, SlurmScheduler, render_serve_script, sbatch_option_args

__all__ = ["SlurmScheduler", "SlurmError", "OPTIONS", "OPTION_FLAGS", "render_serve_script", "sbatch_option_args"]
