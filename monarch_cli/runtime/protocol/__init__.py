"""Every message between the runtime's processes, defined once: see :mod:`.base` for how
they travel, and the modules below for the messages themselves. Import this package, not
its modules: ``protocol.Output``, ``protocol.decode(head)``."""

from .base import *  # noqa: F401,F403
from .from_agent import *  # noqa: F401,F403
from .links import *  # noqa: F401,F403
from .procs import *  # noqa: F401,F403
from .records import *  # noqa: F401,F403
from .sync import *  # noqa: F401,F403
from .to_agent import *  # noqa: F401,F403
from .zygote import *  # noqa: F401,F403
