"""The actor API: actors and endpoints, shapes, host/proc/actor meshes, and the proc that hosts actors.

:mod:`.actor`, :mod:`.shape` and :mod:`.mesh` run wherever user code drives actors (the client's
controller, or inside an actor); :mod:`.proc` is the main of a proc process, forked by a host agent.
Its own package because it is what users import (``monarch_cli.runtime`` re-exports it), built on
the mailbox and never on the agent.
"""
