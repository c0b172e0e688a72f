"""Every setting of monarch-cli, declared once: the runtime's, and each ``MONARCH_*`` variable.

* :class:`Settings`: the actor runtime's, set once per process with :func:`configure`. They travel
  to every proc a process spawns (inside the bootstrap message), so a controller's choice of
  timeouts holds across the whole mesh.
* :class:`EnvSettings`: what a user sets in the environment, one :class:`Var` per ``MONARCH_*``
  variable (its type, default, and who reads it). ``env.<field>`` reads the variable when asked,
  never cached: a child reads what its parent set, and a test's ``setenv`` holds at once.
* :data:`INTERNAL`: the variables one of our processes sets for another (keys, a rank's spec):
  not settings, never listed, the keys never printed.

No other module spells a ``MONARCH_*`` name (``tests/test_config.py`` checks). Importing this
module stays as cheap as it was: it is loaded by every rank and every ``monarch`` command.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


@dataclasses.dataclass
class Settings:
    #: Default timeout (seconds) for ``Future.get()`` when none is given; ``None`` waits forever.
    call_timeout: float | None = None
    #: How long ``spawn_procs``/``spawn`` may take before they fail.
    spawn_timeout: float = 60.0
    #: Interval of the liveness heartbeat between a process and the agents it uses.
    heartbeat_interval: float = 0.5
    #: Silence after which an agent (or a client, seen from the agent) counts as gone. 4 s, so a
    #: lost host is named within 5 s of going quiet (its last answer comes up to an interval
    #: before that; thousands of hosts add reading latency). 5 s had named it at 5.0-5.9 s. The
    #: judgement guards against blaming hosts for the client's own slowness (heartbeats.py).
    heartbeat_timeout: float = 4.0
    #: ``"tcp"`` (CURVE-encrypted, works across hosts) or ``"ipc"`` (unix sockets, one host).
    transport: str = "tcp"
    #: Address other hosts use to reach this process; default: ``env.host`` or this host's IP.
    host: str | None = None
    #: Grace period between SIGTERM and SIGKILL when a proc mesh stops.
    stop_grace: float = 5.0
    #: Keep every TCP port this process (and the procs it spawns) listens on within [lo, hi].
    port_range: tuple[int, int] | None = None
    #: From this many hosts, a run and a question to every host (``status``, ``stack``) go through
    #: ~√N of them (relays) instead of a connection per host (:mod:`monarch_cli.jobs.fanout`). 64:
    #: a fresh CLI's CURVE handshakes are most of its per-host CPU, and from 64 hosts the relays
    #: cost no wall time even with every agent on the client's two cores (docs/decisions/0005).
    relay_from_hosts: int = 64


_settings = Settings()
_FIELDS = {f.name for f in dataclasses.fields(Settings)}


def configure(**kwargs: Any) -> Settings:
    """Change runtime settings for this process (and the procs it spawns from now on)."""
    unknown = set(kwargs) - _FIELDS
    if unknown:
        raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(_FIELDS))}")
    if "transport" in kwargs and kwargs["transport"] not in ("tcp", "ipc"):
        raise ValueError(f"transport must be 'tcp' or 'ipc', not {kwargs['transport']!r}")
    if kwargs.get("port_range") is not None:
        lo, hi = kwargs["port_range"]
        if not 0 < int(lo) <= int(hi) < 65536:
            raise ValueError(f"port_range must be (lo, hi) with 0 < lo <= hi < 65536, not {kwargs['port_range']!r}")
        kwargs["port_range"] = (int(lo), int(hi))
    for name, value in kwargs.items():
        setattr(_settings, name, value)
    return _settings


def settings() -> Settings:
    return _settings


def advertised_host() -> str:
    """The address peers should use to reach sockets bound by this process."""
    if _settings.host:
        return _settings.host
    given = env.host
    if given:
        return given
    # _socket, not socket: the wrapper module (~2 ms to import) is not needed for these two calls,
    # which run on every `monarch run-spmd`.
    import _socket

    name = _socket.gethostname()
    try:
        # An ASCII name goes as bytes, which the C function takes as they are (typeshed says str): a
        # str is encoded with the "idna" codec, whose first use imports encodings.idna, stringprep
        # and unicodedata (1-3 ms).
        addr = _socket.gethostbyname(name.encode() if name.isascii() else name)  # type: ignore[arg-type]
    except OSError:
        return "127.0.0.1"
    return addr or "127.0.0.1"


def listen_host() -> str:
    """The address servers bind: ``env.listen_host`` (``0.0.0.0`` in a Kubernetes pod, where a
    port-forward connects to the pod's localhost) or else the advertised address."""
    return env.listen_host or advertised_host()


def bind_port_candidates() -> list[int]:
    """Ports to try when binding a listening socket: [0] (any) unless a port range is set.

    The range is tried from a random starting point, so processes sharing it rarely collide.
    """
    if _settings.port_range is None:
        return [0]
    import random

    lo, hi = _settings.port_range
    ports = list(range(lo, hi + 1))
    start = random.randrange(len(ports))
    return ports[start:] + ports[:start]


# ---------------------------------------------------------------------- MONARCH_* variables
#: Words a flag takes (any case); empty means unset.
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Kind(Generic[T]):
    """How a variable's text becomes a value; ``expects`` completes "expected ..." in its error."""

    expects: str
    parse: Callable[[str], T]


def _seconds(text: str) -> float:
    value = float(text)
    if math.isnan(value) or value < 0:
        raise ValueError(text)
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _flag(text: str) -> bool:
    word = text.strip().lower()
    if word not in _ON + _OFF:
        raise ValueError(text)
    return word in _ON


SECONDS = Kind("a number of seconds", _seconds)
COUNT = Kind("a whole number (0 or more)", _count)
FLAG = Kind("one of 1/0, true/false, yes/no, on/off", _flag)
TEXT = Kind("text", str)


class Var(Generic[T]):
    """One ``MONARCH_*`` setting: its variable, the kind of its value, its default, who reads it, and why.

    A field of :class:`EnvSettings`: ``env.name`` is the value now (parsed each time: the variable
    may have been set since), ``EnvSettings.name`` this declaration (``.var`` its variable's name).
    """

    def __init__(
        self,
        var: str,
        kind: Kind[Any],
        default: T,
        readers: str,
        doc: str,
        *,
        keep_empty: bool = False,
        secret: bool = False,
    ) -> None:
        self.var, self.kind, self.default, self.readers, self.doc = var, kind, default, readers, doc
        #: Empty text is a value (``py_spy``: empty means no py-spy), not "unset" as for every other one.
        self.keep_empty = keep_empty
        #: The value may hold a secret (credentials in a URL): listed as set or not, never as its text.
        self.secret = secret
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Var[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Var[T] | T:
        return self if obj is None else self.read()

    def text(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text (stripped), or None when it is unset (or empty, unless empty means something)."""
        raw = (os.environ if environ is None else environ).get(self.var)
        if raw is None:
            return None
        raw = raw.strip()
        return raw if raw or self.keep_empty else None

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in ``environ`` (default: this process's environment now), or the default.

        A value that does not parse is a one-line :class:`~monarch_cli.errors.OptionError` naming
        the variable: a typo in the environment must not pass for the default.
        """
        raw = self.text(environ)
        if raw is None:
            return self.default
        try:
            value: T = self.kind.parse(raw)
        except ValueError:
            from .errors import OptionError

            raise OptionError(f"{self.var}: expected {self.kind.expects}, got {raw!r}") from None
        return value


class EnvSettings:
    """The settings a user gives through the environment; readers: client (``monarch``, the job API),
    agent (each host's agent and its warm processes), rank (inside the user's processes)."""

    # where processes listen and keep things
    host: Var[str | None] = Var(
        "MONARCH_HOST", TEXT, None, "client, agent", "address this process gives its peers (default: this host's IP)"
    )
    listen_host: Var[str | None] = Var(
        "MONARCH_LISTEN_HOST", TEXT, None, "agent", "address servers bind, e.g. 0.0.0.0 in a pod (default: the host's)"
    )
    remote_dir: Var[str | None] = Var(
        "MONARCH_REMOTE_DIR", TEXT, None, "agent", "where a host keeps reservations' files (default: ~/.monarch-cli)"
    )
    cache_dir: Var[str | None] = Var(
        "MONARCH_CACHE_DIR",
        TEXT,
        None,
        "client, agent",
        "what monarch learns or builds on a machine: wheels, split logs (default: $XDG_CACHE_HOME/monarch-cli)",
    )
    state: Var[str | None] = Var(
        "MONARCH_STATE", TEXT, None, "client", "the job state file (default: .monarch/job_state.pkl here or above)"
    )
    # a run
    stall_timeout: Var[float | None] = Var(
        "MONARCH_STALL_TIMEOUT", SECONDS, None, "client", "end a run whose ranks are all silent this long (0: off)"
    )
    keep_runs: Var[int] = Var("MONARCH_KEEP_RUNS", COUNT, 20, "client", "runs whose logs are kept (0: every run)")
    sync_max_bytes: Var[int] = Var(
        "MONARCH_SYNC_MAX_BYTES", COUNT, 1 << 30, "client", "largest workspace a run syncs (past it: data, not code)"
    )
    partition_probe_interval: Var[float | None] = Var(
        "MONARCH_PARTITION_PROBE_INTERVAL",
        SECONDS,
        None,
        "client",
        "seconds between the hosts' rounds of probing each other (default: 5)",
    )
    ssh_agent_lease: Var[float] = Var(
        "MONARCH_SSH_AGENT_LEASE", SECONDS, 300.0, "client", "how long an ssh host's agent outlives its last client"
    )
    skypilot_provisioner: Var[str | None] = Var(
        "MONARCH_SKYPILOT_PROVISIONER", TEXT, None, "client", "module:factory standing in for SkyPilot's SDK (tests)"
    )
    # warm processes and ranks
    learn_preload: Var[bool] = Var(
        "MONARCH_LEARN_PRELOAD", FLAG, True, "agent", "warm processes learn and preload what runs import"
    )
    cuda_ready: Var[bool] = Var(
        "MONARCH_CUDA_READY", FLAG, True, "rank", "make the rank's CUDA device ready before its script runs"
    )
    # telemetry
    telemetry: Var[bool] = Var(
        "MONARCH_TELEMETRY", FLAG, True, "client", "record runs' telemetry (off: for A/B benchmarks)"
    )
    telemetry_runs: Var[int] = Var(
        "MONARCH_TELEMETRY_RUNS", COUNT, 50, "client", "runs the telemetry store keeps per reservation"
    )
    telemetry_lines: Var[int] = Var(
        "MONARCH_TELEMETRY_LINES", COUNT, 20_000, "client", "output lines the store keeps per run (first and last half)"
    )
    telemetry_interval: Var[float] = Var(
        "MONARCH_TELEMETRY_INTERVAL", SECONDS, 1.0, "agent", "seconds between an agent's telemetry pushes"
    )
    py_spy: Var[str | None] = Var(
        "MONARCH_PY_SPY",
        TEXT,
        None,
        "agent",
        "the py-spy to sample stacks with; empty: none (default: beside Python, else on PATH)",
        keep_empty=True,
    )
    otlp_endpoint: Var[str | None] = Var(
        "MONARCH_OTLP_ENDPOINT",
        TEXT,
        None,
        "client",
        "OpenTelemetry collector URL for runs ('off' or empty: none); may hold credentials, never shown",
        keep_empty=True,
        secret=True,
    )
    otlp_timeout: Var[float] = Var("MONARCH_OTLP_TIMEOUT", SECONDS, 3.0, "client", "seconds one OTLP export may take")
    # the CLI itself
    debug: Var[bool] = Var("MONARCH_DEBUG", FLAG, False, "client", "show the traceback of an internal error (--debug)")
    debug_history: Var[str | None] = Var(
        "MONARCH_DEBUG_HISTORY",
        TEXT,
        None,
        "client",
        "`monarch debug`'s history file (default: ~/.monarch_debug_history)",
    )


#: The settings, each read when its field is: ``config.env.stall_timeout``.
env = EnvSettings()
#: Every declared setting, in declaration order.
VARS: tuple[Var[Any], ...] = tuple(v for v in vars(EnvSettings).values() if isinstance(v, Var))


def from_environment(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Every setting with its value and where that came from (``"env"`` or ``"default"``), for
    ``monarch version``. A value that does not parse is reported in ``error``, not raised: a bug
    report must list it. A secret setting's value is ``"<redacted>"`` when set."""
    found: dict[str, dict[str, Any]] = {}
    for var in VARS:
        raw = var.text(environ)
        row: dict[str, Any] = {"variable": var.var, "source": "default" if raw is None else "env"}
        if var.secret and raw is not None:
            row["value"] = "<redacted>"
        else:
            try:
                row["value"] = var.read(environ)
            except ValueError as e:
                row["value"], row["error"] = None, str(e)
        row.update(default=var.default, read_by=var.readers, doc=var.doc)
        found[var.name] = row
    return found


def settings_text(environ: Mapping[str, str] | None = None) -> str:
    """``monarch version --settings``: a line per setting (variable, value, where it came from)."""
    rows = from_environment(environ)
    width = max(len(row["variable"]) for row in rows.values())
    lines = []
    for row in rows.values():
        shown = "unset" if row["value"] is None else str(row["value"])
        if "error" in row:
            shown = f"invalid: {row['error']}"
        lines.append(f"{row['variable']:<{width}}  {shown} ({row['source']})")
    return "\n".join(lines)


def settings_markdown() -> str:
    """The Settings table of docs/runtime.md (a test checks the docs hold exactly this)."""
    lines = ["| Variable | Default | Read by | What it does |", "|---|---|---|---|"]
    for var in VARS:
        default = "unset" if var.default is None else str(var.default).lower()
        lines.append(f"| `{var.var}` | {default} | {var.readers} | {var.doc.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- internal hand-offs
#: The prefix of every variable here: a rank's environment leaves the agent's out.
PREFIX = "MONARCH_"
#: The reservation's keys (secret), from a launcher to the agent it starts; removed once read.
KEYS_ENV = "MONARCH_KEYS"
#: Path of a 0600 file holding the keys: scheduler's start line -> the agent (and a pod's bootstrap).
KEY_FILE_ENV = "MONARCH_KEY_FILE"
#: The keys as a SkyPilot secret (secret): the client -> the task's run script, which unsets it.
RESERVATION_KEYS_ENV = "MONARCH_RESERVATION_KEYS"
#: A cold rank's spec (JSON): the agent -> ``runtime.rank.start``, removed before user code runs.
RANK_SPEC_ENV = "MONARCH_RANK_SPEC"
#: The run's id: the agent -> every rank, inherited by its descendants (how a run's processes are found).
RUN_ID_ENV = "MONARCH_RUN_ID"
#: Modules a warm process imports (comma-separated): the agent's fork server -> the zygote.
PRELOAD_ENV = "MONARCH_PRELOAD"
#: The learned modules (JSON list): the agent's fork server -> the zygote.
LEARNED_PRELOAD_ENV = "MONARCH_LEARNED_PRELOAD"
#: Where a zygote writes what it loaded: the agent's fork server -> the zygote.
WARM_READY_ENV = "MONARCH_WARM_READY"
#: Click's shell-completion switch for the ``monarch`` command (set by the shell's completion script).
COMPLETE_ENV = "_MONARCH_COMPLETE"
#: Not a variable: the first words of the line an agent prints (or writes) once it listens.
AGENT_READY_PREFIX = "MONARCH_AGENT_READY "

#: Every internal name: who sets it -> who reads it. None is a setting; the secret ones are never printed.
INTERNAL: dict[str, str] = {
    KEYS_ENV: "secret; launcher -> agent",
    KEY_FILE_ENV: "scheduler start line -> agent, pod bootstrap",
    RESERVATION_KEYS_ENV: "secret; client -> SkyPilot task script",
    RANK_SPEC_ENV: "agent -> cold rank",
    RUN_ID_ENV: "agent -> rank and its descendants",
    PRELOAD_ENV: "fork server -> zygote",
    LEARNED_PRELOAD_ENV: "fork server -> zygote",
    WARM_READY_ENV: "fork server -> zygote",
    COMPLETE_ENV: "shell completion script -> monarch",
    AGENT_READY_PREFIX.strip(): "agent's ready line -> its launcher",
}
#: Names whose values are secrets: never printed, by ``monarch version`` or anything else.
SECRETS = frozenset({KEYS_ENV, RESERVATION_KEYS_ENV})
