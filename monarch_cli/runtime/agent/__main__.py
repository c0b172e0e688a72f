"""``python -m monarch_cli.runtime.agent``: the host agent's entry point (see :mod:`.host`)."""

import sys

from .host import main

sys.exit(main())
