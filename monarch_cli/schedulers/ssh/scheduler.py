"""The ssh backend: one detached host agent per machine you reach by SSH (paramiko).

Hosts come from ``--hosts h1,h2`` (:attr:`ReserveRequest.host_names`), ``--host`` and
``--hostfile``, and resolve through the SSH config. ``plan()`` resolves every target and
writes, per host, exactly what will be checked, uploaded and run (keys redacted: they are
never in the plan). ``reserve(plan)`` does that per host, in parallel: connect (the host key
checked against known_hosts: an unknown key is refused unless ``accept_new_host_keys``, which
records it; a changed key is always refused), check that the remote interpreter has this
monarch-cli version, upload the reservation's keys over SFTP into a 0700 directory as a 0600
file (never on a command line or in an environment), and start the agent detached with a pid
file. ``release`` ends it (TERM, then KILL its process group) and removes the directory,
which also holds the workspace mirror. A host that fails leaves nothing behind on the others.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import getpass
import logging
import os
import shlex
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...config import KEY_FILE_ENV, EnvSettings, env
from ...errors import OptionError, PlanError, SchedulerError
from ...runtime.launch import bundle, bundle_host
from ...runtime.launch.command import READY_PREFIX, AgentCommand, is_agent_command
from ...version import __version__
from ..agents import wait_for_agents
from ..base import (
    HostRecord,
    Liveness,
    Option,
    Plan,
    Probe,
    Progress,
    Reservation,
    ReservationRecord,
    ReserveRequest,
    Scheduler,
)

if TYPE_CHECKING:
    import paramiko

    from ...runtime.transport.keys import Keys

#: How long an agent may take to listen (it imports torch to warm up).
AGENT_START_TIMEOUT = 60.0
#: How long ``probe`` waits for a host's sshd before answering "cannot tell".
PROBE_TIMEOUT = 5.0
DEFAULT_PYTHON = "python3"
#: Seconds a new agent lives unless a client holding the keys asks it something (``serve`` does
#: once it saved the reservation): a serve killed before that leaves nothing running. Covers
#: shipping to the slowest host, every agent's start and the hosts' reachability check.
#: ``$MONARCH_SSH_AGENT_LEASE`` changes it.
AGENT_LEASE: float = EnvSettings.ssh_agent_lease.default
DEFAULT_REMOTE_DIR = "~/.monarch-cli"


@dataclasses.dataclass
class SshTarget:
    """One host as the SSH config resolves it (what the plan prints)."""

    alias: str
    hostname: str
    port: int
    user: str
    identities: list[str]
    known_hosts: str
    strict: str  # StrictHostKeyChecking: yes / accept-new / no
    proxy_jump: str | None
    config_path: str = ""  # the SSH config it came from (its jump host resolves there too)

    def describe(self) -> str:
        via = f" via {self.proxy_jump}" if self.proxy_jump else ""
        return f"{self.user}@{self.hostname}:{self.port}{via}"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SshTarget:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def host_names(request: ReserveRequest) -> list[str]:
    """The hosts named by ``--hosts h1,h2``, ``--host`` (repeatable) and ``--hostfile``, in that order."""
    opts = request.options
    names = list(request.host_names)
    for item in opts.get("host") or []:
        names += [h.strip() for h in str(item).split(",") if h.strip()]
    if opts.get("hostfile"):
        try:
            text = Path(opts["hostfile"]).expanduser().read_text()
        except OSError as e:
            raise OptionError(f"cannot read --hostfile {opts['hostfile']}: {e.strerror}") from None
        names += [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]
    if not names:
        raise OptionError("the ssh scheduler needs hosts by name: --hosts h1,h2 or --hostfile FILE")
    if len(set(names)) != len(names):
        raise OptionError(f"a host is named twice: {','.join(names)}")
    return names


def resolve(alias: str, opts: dict[str, Any]) -> SshTarget:
    """``alias`` through the SSH config (``~/.ssh/config`` or ``ssh_config``); flags win over it."""
    import paramiko

    path = Path(opts.get("ssh_config") or "~/.ssh/config").expanduser()
    config = paramiko.SSHConfig()
    if path.exists():
        try:
            config = paramiko.SSHConfig.from_path(str(path))
        except Exception as e:  # noqa: BLE001 - a malformed config is the user's to fix
            raise OptionError(f"cannot parse SSH config {path}: {e}") from None
    elif opts.get("ssh_config"):
        raise OptionError(f"--ssh-config {path} does not exist")
    c = config.lookup(alias)
    identities = (
        [str(Path(opts["identity"]).expanduser())]
        if opts.get("identity")
        else [os.path.expanduser(p) for p in c.get("identityfile", [])]
    )
    known = os.path.expanduser(str(c.get("userknownhostsfile", "~/.ssh/known_hosts")).split()[0])
    return SshTarget(
        alias,
        c.get("hostname", alias),
        int(c.get("port", 22)),
        opts.get("user") or c.get("user") or getpass.getuser(),
        identities,
        known,
        str(c.get("stricthostkeychecking", "yes")).lower(),
        c.get("proxyjump"),
        str(path) if path.exists() else "",
    )


def _host_error(target: SshTarget, what: str) -> SchedulerError:
    return SchedulerError(f"host {target.alias} ({target.hostname}:{target.port}): {what}")


def _connection_lost(target: SshTarget, client: Any, e: BaseException) -> SchedulerError | None:
    """The error to raise for ``e`` when ``client``'s connection has dropped (sshd died, the link
    went down); paramiko says only ``EOFError`` or ``SSH session not active``. None when it has not."""
    if isinstance(e, SchedulerError) or not isinstance(e, Exception):
        return None
    if not isinstance(e, (EOFError, ConnectionError)):
        import paramiko

        transport = client.get_transport()
        # paramiko's own errors may come a moment before its reader thread sees the connection drop;
        # an SFTP status (a file not there yet) is an answer: the connection is up.
        waits = 10 if isinstance(e, paramiko.SSHException) else 0
        for i in range(waits + 1):
            if transport is None or not transport.is_active():
                break
            if i < waits:
                time.sleep(0.1)
        else:
            return None
    why = str(e) or type(e).__name__
    return _host_error(target, f"the SSH connection was lost during serve ({why}): is sshd still running there?")


def _key_policy(target: SshTarget, accept_new: bool) -> paramiko.MissingHostKeyPolicy:
    """Unknown key: refuse, or record it (accept-new). A changed key paramiko refuses itself.
    (Made here, not at import: the module imports paramiko only when it connects.)"""
    import paramiko

    class KeyPolicy(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
            if not accept_new:
                raise _host_error(
                    target,
                    f"unknown host key ({key.get_name()} {key.get_fingerprint().hex()}); "
                    "check it and pass --accept-new-host-keys to record it",
                )
            client.get_host_keys().add(hostname, key.get_name(), key)
            known = Path(target.known_hosts)
            known.parent.mkdir(parents=True, exist_ok=True)
            with open(known, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")

    return KeyPolicy()


def _paramiko_to_log_file() -> None:
    """paramiko's own log lines (a banner timeout's traceback, a refused channel) go to
    ``<cache>/ssh.log``, never the terminal: our error says what happened in one line."""
    log = logging.getLogger("paramiko")
    if getattr(log, "_monarch_file", False):
        return
    log._monarch_file = True  # type: ignore[attr-defined]
    log.propagate = False
    from ...sysutil import cache_dir

    handler: logging.Handler
    try:
        os.makedirs(cache_dir(), mode=0o700, exist_ok=True)
        path = os.path.join(cache_dir(), "ssh.log")
        os.close(os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600))
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
    except OSError:
        handler = logging.NullHandler()
    log.addHandler(handler)


def connect(target: SshTarget, accept_new: bool, timeout: float = 15.0) -> Any:
    """An authenticated paramiko client for ``target`` (through its ProxyJump, if any)."""
    import paramiko

    _paramiko_to_log_file()

    sock = None
    if target.proxy_jump:
        jump_alias = target.proxy_jump.split(",")[0]
        jump = connect(resolve(jump_alias, {"ssh_config": target.config_path or None}), accept_new, timeout)
        try:
            sock = jump.get_transport().open_channel("direct-tcpip", (target.hostname, target.port), ("", 0))
        except Exception as e:  # noqa: BLE001 - paramiko's ChannelException and friends
            jump.close()
            raise SchedulerError(
                f"host {target.alias}: jump host {jump_alias} cannot reach {target.hostname}:{target.port}: {e}"
            ) from None
    client = paramiko.SSHClient()
    if os.path.exists(target.known_hosts):
        client.load_host_keys(target.known_hosts)
    client.set_missing_host_key_policy(_key_policy(target, accept_new or target.strict in ("accept-new", "no")))
    known_name = target.hostname if target.port == 22 else f"[{target.hostname}]:{target.port}"
    try:
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            # paramiko takes a filename or a list of them; types-paramiko allows only the str
            key_filename=target.identities or None,  # type: ignore[arg-type]
            allow_agent=True,
            look_for_keys=not target.identities,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            sock=sock,
        )
    except SchedulerError:
        raise
    except paramiko.BadHostKeyException:
        raise _host_error(
            target,
            f"the host key has CHANGED since it was recorded in {target.known_hosts} "
            f"(entry {known_name}); refusing to connect",
        ) from None
    except paramiko.AuthenticationException as e:
        raise SchedulerError(f"host {target.alias}: authentication as {target.user} failed ({e})") from None
    except (OSError, EOFError, paramiko.SSHException) as e:
        why = str(e) or type(e).__name__
        if isinstance(e, paramiko.SSHException) and ("banner" in why or "No existing session" in why):
            why = f"no SSH server answered there (no SSH banner within {timeout:.0f} s)"  # paramiko's words vary
        raise SchedulerError(f"host {target.alias} ({target.hostname}:{target.port}) is unreachable: {why}") from None
    if sock is not None:
        client._monarch_jump = jump  # type: ignore[attr-defined]  # lives as long as the connection through it
    return client


def _run(client: Any, command: str, timeout: float = 60.0) -> tuple[int, str]:
    _, out, err = client.exec_command(command, timeout=timeout)
    text = out.read().decode(errors="replace") + err.read().decode(errors="replace")
    return out.channel.recv_exit_status(), text


def _shell_path(path: str) -> str:
    """``path`` for the remote shell: a leading ``~/`` expands there, the rest is quoted."""
    if path == "~" or path.startswith("~/"):
        rest = path[2:]
        return '"$HOME"' + ("/" + shlex.quote(rest) if rest else "")
    return shlex.quote(path)


def _bundles_dir(root: str) -> str:
    return f"{root.rstrip('/')}/bundles"


def _start_command(python: str, directory: str, root: str, target: SshTarget, agent: AgentCommand) -> str:
    """The one shell line that starts ``agent`` detached in ``directory`` (which holds its keys).

    ``$CODE`` and ``$DEPS`` name the bundle's parts (found when the host is probed; serve sets
    them in front of this line). The agent advertises the address the client reached the host
    at (``SSH_CONNECTION``'s third field), not what the host's own name resolves to (often
    ``127.0.1.1``); the resolved ``HostName`` only if sshd does not say.
    """
    argv = [*shlex.split(python), *agent.argv()[1:]]
    bundles = _shell_path(_bundles_dir(root))
    env = (
        f'{KEY_FILE_ENV}="$PWD/keys" {EnvSettings.host.var}="${{3:-$H}}" '
        f"{EnvSettings.remote_dir.var}={_shell_path(root)} "
        f'PYTHONPATH="$B/$CODE${{PYTHONPATH:+:$PYTHONPATH}}" {EnvSettings.py_spy.var}="$B/$DEPS/bin/py-spy"'
    )
    # Not `cd && agent &`: that backgrounds a subshell, whose pid $! would be, and which keeps
    # the SSH channel open. setsid does not fork here (a background job is no group leader).
    return (
        f"cd {_shell_path(directory)} || exit 1; B={bundles}; H={shlex.quote(target.hostname)}; "
        'touch -c "$B/$CODE" "$B/$DEPS"; set -- $SSH_CONNECTION; '
        f"{env} nohup setsid {shlex.join(argv)} > agent.log 2>&1 "
        "< /dev/null & echo $! > agent.pid"
    )


def _lease() -> float:
    """``env.ssh_agent_lease`` (a bad value is a one-line error naming its variable)."""
    return env.ssh_agent_lease


class SshScheduler(Scheduler):
    name = "ssh"
    takes_host_names = True
    leases_agents = True
    options = (
        Option("host", list, help="A host to reserve, by name (repeatable); same as --hosts h1,h2."),
        Option("hostfile", str, help="A file of host names, one a line (# starts a comment)."),
        Option("ssh_config", str, help="The SSH config that resolves host names (default ~/.ssh/config)."),
        Option("identity", str, help="The private key file (default: the SSH config's, ssh-agent, ~/.ssh/id_*)."),
        Option("user", str, help="The remote user (default: the SSH config's, else yours)."),
        Option(
            "python",
            str,
            default=DEFAULT_PYTHON,
            help=f"The remote interpreter command (default {DEFAULT_PYTHON}); Python >= "
            f"{'.'.join(map(str, bundle.MIN_PYTHON))}; it needs nothing of ours: the client ships its code.",
        ),
        Option(
            "wheelhouse",
            str,
            help="A directory of wheels of our runtime dependencies for the hosts' platform and Python "
            "(default: this client's package index, downloaded once into a cache).",
        ),
        Option(
            "remote_dir",
            str,
            default=DEFAULT_REMOTE_DIR,
            help=f"Where serve puts its files on each host (default {DEFAULT_REMOTE_DIR}).",
        ),
        Option(
            "accept_new_host_keys",
            bool,
            default=False,
            help="Record unknown host keys in known_hosts (a changed key is always refused).",
        ),
        Option(
            "tunnel",
            bool,
            default=False,
            help="Reach each agent's one port through a forward over SSH (ssh -L), for a client that cannot "
            "reach the hosts' ports or that they cannot reach.",
        ),
    )

    # ---------------------------------------------------------------- planning
    def plan(self, request: ReserveRequest, workdir: Path) -> Plan:
        opts = self.check_options(request.options)
        names = host_names(request)
        if not request.host_names and request.hosts not in (1, len(names)):
            raise OptionError(f"{len(names)} host(s) are named but {request.hosts} were asked for")
        python = opts.get("python") or DEFAULT_PYTHON
        root = (opts.get("remote_dir") or DEFAULT_REMOTE_DIR).rstrip("/") or "/"
        rid = f"ssh-{uuid.uuid4().hex[:8]}"
        directory = f"{root}/{rid}"
        hosts, steps = [], []
        ship = bundle.plan_lines(python, _bundles_dir(root), opts.get("wheelhouse"))
        for alias in names:
            target = resolve(alias, opts)
            agent = request.agent_command(rid, python=python, name=alias, address_file="agent.addr", lease=_lease())
            command = _start_command(python, directory, root, target, agent)
            hosts.append(
                {
                    "target": dataclasses.asdict(target),
                    "directory": directory,
                    "agent": agent.to_json(),
                    "command": command,
                }
            )
            keys = ", ".join(target.identities) or "ssh-agent / default keys"
            steps += [
                f"{alias}: connect to {target.describe()} (keys: {keys}; known hosts: {target.known_hosts}, "
                f"{'record unknown keys' if opts.get('accept_new_host_keys') else 'unknown keys refused'})",
                *(f"{alias}: {line}" for line in ship),
                f"{alias}: upload over SFTP: {directory}/keys  (0600 in a 0700 directory; the reservation's "
                "keys: <redacted>)",
                f"{alias}: run: CODE=code-<hash> DEPS=deps-<hash>; {command}",
            ]
        steps.append(
            f"wait until {len(names)} agent(s) have written agent.addr; a host that fails is reported by "
            "name and the others are cleaned up"
        )
        if len(names) > 1:
            steps.append(
                "every host opens a TCP connection to every other host's agent; a pair that cannot is named "
                "and nothing is left running"
            )
        if opts.get("tunnel"):
            steps.append("every client process reaches each agent's port through a forward over its SSH connection")
        summary = (
            f"start a detached host agent on {len(names)} SSH host(s) ({', '.join(names)}), set up in "
            "parallel, with a fresh key pair (0600 in the job state here, uploaded over SFTP there)"
        )
        data = {
            "hosts": hosts,
            "python": python,
            "remote_dir": root,
            "version": __version__,
            "wheelhouse": opts.get("wheelhouse"),
            "accept_new_host_keys": bool(opts.get("accept_new_host_keys")),
            "tunnel": bool(opts.get("tunnel")),
        }
        return Plan(
            self.name,
            rid,
            len(names),
            list(request.command),
            str(workdir.resolve()),
            summary,
            steps,
            options=opts,
            data=data,
        )

    # ---------------------------------------------------------------- reserving
    def reserve(self, plan: Plan, keys: Keys, progress: Progress) -> Reservation:
        self.check_plan(plan)
        try:
            hosts = plan.data["hosts"]
            python, root, accept_new = plan.data["python"], plan.data["remote_dir"], plan.data["accept_new_host_keys"]
            targets = [SshTarget.from_json(h["target"]) for h in hosts]
            agents = [AgentCommand.from_json(h["agent"]) for h in hosts]
        except (KeyError, TypeError) as e:
            raise PlanError(f"malformed ssh plan ({type(e).__name__}: {e}); make a new one with --dry-run") from None
        if plan.data.get("version") != __version__:
            raise PlanError(f"this plan was made by monarch-cli {plan.data.get('version')}, not {__version__}")
        started: dict[int, dict[str, Any]] = {}
        errors: list[str] = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as pool:
            futures = {
                pool.submit(
                    self._start_host,
                    targets[i],
                    h["directory"],
                    h["command"],
                    python,
                    keys,
                    accept_new,
                    progress,
                    started,
                    i,
                    root,
                    plan.data.get("wheelhouse"),
                ): i
                for i, h in enumerate(hosts)
            }
            for fut in concurrent.futures.as_completed(futures):
                i = futures[fut]
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - every host's failure is reported, then all are undone
                    errors.append(
                        str(e) if isinstance(e, SchedulerError) else f"host {targets[i].alias}: {type(e).__name__}: {e}"
                    )
        found: list[HostRecord] = []
        try:
            if not errors:
                names = [str(a.name) for a in agents]
                try:
                    found = wait_for_agents(
                        lambda: self._discover(started, names),
                        names,
                        progress,
                        timeout=AGENT_START_TIMEOUT,
                        check=lambda: self._check(started, names),
                        interval=0.2,
                    )
                except SchedulerError as e:
                    errors.append(str(e))
            if not errors and len(found) > 1:
                progress("checking that the hosts reach each other")
                errors += _cross_check(started, found, python)
            if errors:
                raise SchedulerError(
                    errors[0] + (f" (and {len(errors) - 1} more host(s) failed)" if len(errors) > 1 else "")
                )
        except BaseException:  # a failed host or Ctrl-C: no half reservation is left behind
            self._release_hosts([started[i]["record"] for i in sorted(started)], accept_new)
            raise
        finally:
            for entry in started.values():
                _close(entry)
        records = [started[i]["record"] for i in range(len(hosts))]
        for rec, host in zip(records, found):
            rec["address"] = host.agent
        return Reservation(
            plan.reservation_id,
            [HostRecord(h.name, h.agent, rec["pid"], h.node_rank) for h, rec in zip(found, records)],
            {
                "ssh_hosts": records,
                "accept_new_host_keys": accept_new,
                "remote_dir": root,
                "tunnel": bool(plan.data.get("tunnel")),
            },
        )

    def _start_host(
        self,
        target: SshTarget,
        directory: str,
        command: str,
        python: str,
        keys: Keys,
        accept_new: bool,
        progress: Progress,
        started: dict[int, dict[str, Any]],
        index: int,
        root: str = DEFAULT_REMOTE_DIR,
        wheelhouse: str | None = None,
    ) -> None:
        """Connect, probe, ship what the host lacks, upload the keys, start the agent; leaves the
        connection in ``started``."""
        progress(f"{target.alias}: connecting to {target.describe()}")
        client = connect(target, accept_new)
        record: dict[str, Any] = {**dataclasses.asdict(target), "directory": directory, "pid": None, "address": ""}
        made = False
        try:
            parts = _ship(client, target, python, root, wheelhouse, progress)
            record["bundle"] = parts
            command = f"CODE={parts['code']} DEPS={parts['deps']}; {command}"
            sftp = client.open_sftp()
            try:
                path = _remote_path(sftp, directory)
                sftp.mkdir(path, mode=0o700)  # new, in the remote dir the probe made private: never one found there
                record["directory"], made = path, True  # from here on, release removes it
                sftp.chmod(path, 0o700)
                with sftp.open(f"{path}/keys", "w") as f:
                    f.chmod(0o600)  # before the secret is written
                    f.write(keys.encode().encode() + b"\n")
                progress(f"{target.alias}: starting the agent")
                code, text = _run(client, command)
                if code != 0:
                    raise _host_error(target, f"could not start the agent: {text.strip()[-300:] or f'status {code}'}")
                record["pid"] = int(_read(sftp, f"{path}/agent.pid").strip())
            except OSError as e:  # SFTP: a full disk, a read-only home, permissions
                raise _connection_lost(target, client, e) or _host_error(
                    target, f"cannot set up {directory}: {e.strerror or e}"
                ) from None
            finally:
                sftp.close()
        except BaseException as e:
            lost = _connection_lost(target, client, e)
            if made:
                try:
                    _stop_host(client, record)
                except Exception:  # noqa: BLE001 - the connection is gone: release asks again over a new one
                    pass
            client.close()
            if lost is not None:
                raise lost from None
            raise
        started[index] = {"client": client, "record": record, "target": target}

    def _discover(self, started: dict[int, dict[str, Any]], names: list[str]) -> dict[str, str]:
        found = {}
        for i, entry in started.items():
            try:
                if "sftp" not in entry:
                    entry["sftp"] = entry["client"].open_sftp()
                text = _read(entry["sftp"], f"{entry['record']['directory']}/agent.addr")
            except Exception as e:  # noqa: BLE001 - not there yet, unless the connection is gone
                lost = _connection_lost(entry["target"], entry["client"], e)
                if lost is not None:
                    raise lost from None
                if not isinstance(e, OSError):
                    raise
                continue
            if text.startswith(READY_PREFIX) and text.endswith("\n"):
                found[names[i]] = text[len(READY_PREFIX) :].strip()
        return found

    def _check(self, started: dict[int, dict[str, Any]], names: list[str]) -> None:
        """Raise, naming the host, when an agent exited at start-up."""
        for _i, entry in started.items():
            rec, target = entry["record"], entry["target"]
            try:
                if _run(entry["client"], f"kill -0 {int(rec['pid'])}", timeout=15)[0] != 0:
                    code, log = _run(entry["client"], f"tail -n 3 {shlex.quote(rec['directory'] + '/agent.log')}", 15)
                    raise _host_error(target, f"the agent exited at start-up: {log.strip() or 'no log'}")
            except Exception as e:
                lost = _connection_lost(target, entry["client"], e)
                if lost is not None:
                    raise lost from None
                raise

    # ---------------------------------------------------------------- the reservation
    def can_serve(self, reservation: ReservationRecord, request: ReserveRequest) -> str | None:
        names = host_names(request)
        had = [r["alias"] for r in reservation.scheduler_data.get("ssh_hosts", [])]
        if names != had:
            return f"it has hosts {','.join(had)}, not {','.join(names)}"
        return None

    def agent_addresses(self, reservation: ReservationRecord) -> list[str]:
        """With ``tunnel``: a loopback port of this process per host, forwarded over SSH to its agent."""
        if not reservation.scheduler_data.get("tunnel"):
            return super().agent_addresses(reservation)
        from .forward import forward

        accept_new = bool(reservation.scheduler_data.get("accept_new_host_keys"))

        def one(pair: tuple[HostRecord, dict[str, Any]]) -> str:
            host, rec = pair
            where, _, port = host.agent.rpartition("//")[2].rpartition(":")
            try:
                return forward(
                    (reservation.reservation_id, rec["alias"]),
                    lambda: connect(SshTarget.from_json(rec), accept_new),
                    (where, int(port)),
                )
            except SchedulerError:  # unreachable: its agent will not answer, and says so by name
                return host.agent

        pairs = list(zip(reservation.hosts, reservation.scheduler_data.get("ssh_hosts", [])))
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(pairs)))) as pool:
            return list(pool.map(one, pairs))

    def release(self, reservation: ReservationRecord) -> None:
        self._release_hosts(
            reservation.scheduler_data.get("ssh_hosts", []),
            bool(reservation.scheduler_data.get("accept_new_host_keys")),
        )

    def _release_hosts(self, records: list[dict[str, Any]], accept_new: bool = False) -> None:
        _each_host(records, accept_new, _stop_host, timeout=15.0)

    def probe(self, reservation: ReservationRecord) -> Probe:
        """Over SSH: GONE when a reachable host has no agent process; UNKNOWN when a host cannot be reached."""
        records = reservation.scheduler_data.get("ssh_hosts", [])
        answers = _each_host(
            records, bool(reservation.scheduler_data.get("accept_new_host_keys")), _agent_running, timeout=PROBE_TIMEOUT
        )
        gone = [r["alias"] for r, a in zip(records, answers) if a is False]
        if gone:
            return Probe(Liveness.GONE, f"the agent process on {', '.join(gone)} is not running")
        unknown = [r["alias"] for r, a in zip(records, answers) if a is None]
        if unknown:
            return Probe(Liveness.UNKNOWN, f"{', '.join(unknown)} cannot be reached over SSH")
        return Probe(Liveness.ALIVE)

    def describe(self, reservation: ReservationRecord) -> dict[str, Any]:
        return {
            "ssh": [
                {
                    "host": r["alias"],
                    "target": f"{r['user']}@{r['hostname']}:{r['port']}",
                    "pid": r["pid"],
                    "directory": r["directory"],
                }
                for r in reservation.scheduler_data.get("ssh_hosts", [])
            ]
        }

    def status_lines(self, reservation: ReservationRecord) -> list[str]:
        return [
            f"{r['alias']}: {r['user']}@{r['hostname']}:{r['port']}"
            f"{' via ' + r['proxy_jump'] if r.get('proxy_jump') else ''}, agent pid {r['pid']}, files in "
            f"{r['directory']}"
            for r in reservation.scheduler_data.get("ssh_hosts", [])
        ]


def _ship(
    client: Any, target: SshTarget, python: str, root: str, wheelhouse: str | None, progress: Progress
) -> dict[str, Any]:
    """Probe the host's interpreter and the bundle parts it holds (one round trip), send the parts
    it lacks, then unpack them and check every part against its name there (a held part that fails
    is removed and sent once more); ``{"code", "deps", "shipped"}`` (part names, bytes sent)."""
    bundles = _bundles_dir(root)
    data = _probe(client, target, python, bundles)
    try:
        host = bundle.HostPlatform.from_probe(data)
        built = bundle.build(host, wheelhouse)
    except SchedulerError as e:
        raise _host_error(target, str(e)) from None
    missing = built.missing(data.get("held") or [])
    need = sum(p.size + p.unpacked for p in missing)
    if missing and isinstance(data.get("free"), int) and data["free"] < need:
        raise _host_error(
            target,
            f"not enough space for our code and wheels in {bundles}: {data['free'] / 1e6:.1f} MB free, "
            f"{need / 1e6:.1f} MB needed",
        )
    shipped = 0
    for _ in range(2):  # a held part that does not hold what its name says is removed there: send it
        zips = _upload(client, target, bundles, missing, progress)
        shipped += sum(p.size for p in missing)
        args = [zips.get(p.name, p.name) for p in built.parts]
        code, text = _run(client, bundle.unpack_command(python, _shell_path(bundles), args), timeout=300)
        failed = bundle_host.failed_parts(text) if code == bundle_host.MISSING_STATUS else []
        missing = [p for p in built.parts if p.name in failed]
        if not missing:
            break
    if code != 0:
        raise _host_error(target, f"cannot unpack the bundle in {bundles}: {text.strip()[-300:]}")
    return {"code": built.code.name, "deps": built.deps.name, "shipped": shipped}


def _probe(client: Any, target: SshTarget, python: str, bundles: str) -> dict[str, Any]:
    """What the probe says of the host (its bundle directory made private first, or refused)."""
    code, text = _run(client, bundle.probe_command(python, _shell_path(bundles)))
    data = bundle.parse_probe(text) if code == 0 else None
    if data is None:
        last = (text.strip().splitlines() or [f"status {code}"])[-1][-200:]
        raise _host_error(target, f"--python {python} does not run there ({last})")
    if data.get("unsafe"):
        raise _host_error(target, str(data["unsafe"]))
    return data


def _upload(
    client: Any, target: SshTarget, bundles: str, parts: list[bundle.Part], progress: Progress
) -> dict[str, str]:
    """Send ``parts``' zips into ``bundles``; the name each has there, by part."""
    if not parts:
        return {}
    progress(f"{target.alias}: shipping {', '.join(p.name for p in parts)} ({sum(p.size for p in parts) / 1e6:.1f} MB)")
    names = {}
    sftp = client.open_sftp()
    try:
        where = _remote_path(sftp, bundles)
        for part in parts:
            name = f"{part.name}.{uuid.uuid4().hex[:8]}.zip"  # hosts that share a home each send their own
            sftp.put(str(part.path), f"{where}/{name}")
            names[part.name] = name
    except OSError as e:
        raise _connection_lost(target, client, e) or _host_error(
            target, f"cannot upload the bundle to {bundles}: {e.strerror or e}"
        ) from None
    finally:
        sftp.close()
    return names


#: ``python -c CHECK ADDRESS:PORT...``: one line per address this host cannot open a TCP connection to.
_CROSS_CHECK = r"""
import socket, sys
for target in sys.argv[1:]:
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        print(target, e.strerror or e)
"""


def _cross_check(started: dict[int, dict[str, Any]], found: list[HostRecord], python: str) -> list[str]:
    """Every host opens a TCP connection to every other host's agent, from the host itself: a
    firewall or a wrong address between hosts is one line naming both, not a gloo timeout later."""
    where = {h.name: h.agent.rpartition("//")[2] for h in found}

    def one(i: int) -> list[str]:
        entry = started[i]
        me = entry["target"].alias
        others = {name: address for name, address in where.items() if name != me}
        try:
            code, text = _run(
                entry["client"], f"{python} -c {shlex.quote(_CROSS_CHECK)} {shlex.join(others.values())}", 30
            )
        except Exception as e:
            lost = _connection_lost(entry["target"], entry["client"], e)
            if lost is not None:
                return [str(lost)]
            raise
        failed = dict(line.split(" ", 1) for line in text.strip().splitlines() if " " in line) if code == 0 else {}
        return [
            f"host {me} cannot reach host {name} at {address} ({failed[address]}): the ranks' rendezvous "
            "between them would fail; let TCP through between the hosts (their agents' ports and --port-range)"
            for name, address in others.items()
            if address in failed
        ]

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(started)))) as pool:
        return [line for lines in pool.map(one, sorted(started)) for line in lines]


def _each_host(
    records: list[dict[str, Any]], accept_new: bool, action: Callable[[Any, dict[str, Any]], Any], timeout: float
) -> list[Any]:
    """``action(client, record)`` on every host in parallel; None for a host that cannot be reached."""

    def one(rec: dict[str, Any]) -> Any:
        try:
            client = connect(SshTarget.from_json(rec), accept_new, timeout=timeout)
        except SchedulerError:
            return None  # unreachable: nothing more can be done from here
        try:
            return action(client, rec)
        except Exception:  # noqa: BLE001 - a connection that drops mid-way: cannot tell
            return None
        finally:
            client.close()

    if not records:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(records)))) as pool:
        return list(pool.map(one, records))


def _close(entry: dict[str, Any]) -> None:
    if "sftp" in entry:
        entry["sftp"].close()
    entry["client"].close()


def _agent_running(client: Any, rec: dict[str, Any]) -> bool:
    """Is ``rec``'s agent (by pid and command line) still running on the host?"""
    pid = int(rec.get("pid") or 0)
    if not pid:
        return False
    code, text = _run(client, f"cat /proc/{pid}/cmdline 2>/dev/null | tr '\\0' ' '", timeout=PROBE_TIMEOUT)
    return code == 0 and is_agent_command(text)


def _stop_host(client: Any, rec: dict[str, Any]) -> None:
    """TERM the agent (it ends its ranks and procs), KILL its process group after 5 s, remove its directory."""
    pid = int(rec.get("pid") or 0)
    script = ""
    if pid:
        script += (
            f"kill -TERM {pid} 2>/dev/null; for i in $(seq 50); do kill -0 {pid} 2>/dev/null || break; "
            f"sleep 0.1; done; kill -KILL -- -{pid} 2>/dev/null; kill -KILL {pid} 2>/dev/null; "
        )
    if rec.get("directory") and not rec["directory"].startswith("~"):
        script += f"rm -rf {shlex.quote(rec['directory'])}"
    if script:
        _run(client, script, timeout=30)


def _remote_path(sftp: Any, path: str) -> str:
    """``path`` with a leading ``~`` made absolute (SFTP starts in the home directory)."""
    if path == "~" or path.startswith("~/"):
        home = sftp.normalize(".")
        return home + path[1:]
    return path


def _read(sftp: Any, path: str) -> str:
    with sftp.open(path, "r") as f:
        return f.read().decode()


__all__ = ["SshScheduler", "SshTarget", "connect", "resolve", "host_names"]
