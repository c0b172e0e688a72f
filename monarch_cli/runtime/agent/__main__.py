"""``python -m monarch_cli.runtime.agent``: the host agent's entry point (see :mod:`.host`)."""

import os
import sys

from .host import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# Without tearing down every module: its sockets are closed and its children ended already, and
# the teardown was ~40 ms of CPU per agent, seconds for a machine of 128 local agents stopped at once.
os._exit(code)
