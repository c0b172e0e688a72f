"""The ssh backend: one detached host agent per machine you reach by SSH (paramiko).

Options (``serve`` flags): ``ssh_hosts`` (``--hosts h1,h2``: names, resolved through the SSH config), ``hostfile``,
``ssh_config``, ``identity``, ``user``, ``python`` (a command prefix, default ``python3``),
``remote_dir`` (default ``~/.monarch-cli``), ``accept_new_host_keys``.

Per host, in parallel: connect (host key checked against known_hosts: an unknown key is
refused unless ``accept_new_host_keys``, which records it; a changed key is always refused),
check that the remote interpreter has this monarch-cli version, upload the reservation's
keys over SFTP into a 0700 directory as a 0600 file (never on a command line or in an
environment), and start the agent detached with a pid file. ``release`` ends it (TERM, then
KILL its process group) and removes the directory, which also holds the workspace mirror.
A host that fails leaves nothing behind on the others.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import getpass
import os
import shlex
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .. import __version__
from ..jobs.errors import JobError
from ..jobs.state import HostRecord, JobState
from ..runtime.keys import Keys
from .base import DryRun, Progress, Reservation, ReserveRequest, Scheduler

_OPTIONS = {"ssh_hosts", "hostfile", "ssh_config", "identity", "user", "python", "remote_dir", "accept_new_host_keys"}
_AGENT_TIMEOUT = 60.0


@dataclasses.dataclass
class SshTarget:
    """One host as the SSH config resolves it (what ``--dry-run`` prints)."""

    alias: str
    hostname: str
    port: int
    user: str
    identities: List[str]
    known_hosts: str
    strict: str  # StrictHostKeyChecking: yes / accept-new / no
    proxy_jump: Optional[str]
    config_path: str = ""  # the SSH config it came from (its jump host resolves there too)

    def describe(self) -> str:
        via = f" via {self.proxy_jump}" if self.proxy_jump else ""
        return f"{self.user}@{self.hostname}:{self.port}{via}"


def _options(request: ReserveRequest) -> Dict[str, Any]:
    unknown = sorted(set(request.options) - _OPTIONS)
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        raise JobError(f"the ssh scheduler does not take {flags}")
    return dict(request.options)


def host_names(opts: Dict[str, Any]) -> List[str]:
    names: List[str] = []
    given = opts.get("ssh_hosts") or []
    for item in ([given] if isinstance(given, str) else given):
        names += [h.strip() for h in str(item).split(",") if h.strip()]
    if opts.get("hostfile"):
        try:
            text = Path(opts["hostfile"]).expanduser().read_text()
        except OSError as e:
            raise JobError(f"cannot read --hostfile {opts['hostfile']}: {e.strerror}") from None
        names += [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]
    if not names:
        raise JobError("the ssh scheduler needs hosts: --hosts h1,h2 or --hostfile FILE")
    return names


def resolve(alias: str, opts: Dict[str, Any]) -> SshTarget:
    """``alias`` through the SSH config (``~/.ssh/config`` or ``ssh_config``); flags win over it."""
    import paramiko

    path = Path(opts.get("ssh_config") or "~/.ssh/config").expanduser()
    config = paramiko.SSHConfig()
    if path.exists():
        try:
            config = paramiko.SSHConfig.from_path(str(path))
        except Exception as e:  # noqa: BLE001 - a malformed config is the user's to fix
            raise JobError(f"cannot parse SSH config {path}: {e}") from None
    elif opts.get("ssh_config"):
        raise JobError(f"--ssh-config {path} does not exist")
    c = config.lookup(alias)
    identities = [str(Path(opts["identity"]).expanduser())] if opts.get("identity") else [
        os.path.expanduser(p) for p in c.get("identityfile", [])]
    known = os.path.expanduser(str(c.get("userknownhostsfile", "~/.ssh/known_hosts")).split()[0])
    return SshTarget(alias, c.get("hostname", alias), int(c.get("port", 22)),
                     opts.get("user") or c.get("user") or getpass.getuser(), identities, known,
                     str(c.get("stricthostkeychecking", "yes")).lower(), c.get("proxyjump"),
                     str(path) if path.exists() else "")


def _host_key_error(target: SshTarget, accept_new: bool, what: str) -> JobError:
    return JobError(f"host {target.alias} ({target.hostname}:{target.port}): {what}")


class _KeyPolicy:
    """Unknown key: refuse, or record it (accept-new). A changed key paramiko refuses itself."""

    def __init__(self, target: SshTarget, accept_new: bool) -> None:
        self.target, self.accept_new = target, accept_new

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        if not self.accept_new:
            raise _host_key_error(self.target, False, f"unknown host key ({key.get_name()} {key.get_fingerprint().hex()}); "
                                  "check it and pass --accept-new-host-keys to record it")
        client.get_host_keys().add(hostname, key.get_name(), key)
        known = Path(self.target.known_hosts)
        known.parent.mkdir(parents=True, exist_ok=True)
        with open(known, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def connect(target: SshTarget, accept_new: bool, timeout: float = 15.0) -> Any:
    """An authenticated paramiko client for ``target`` (through its ProxyJump, if any)."""
    import paramiko

    sock = None
    if target.proxy_jump:
        jump_alias = target.proxy_jump.split(",")[0]
        jump = connect(resolve(jump_alias, {"ssh_config": target.config_path or None}), accept_new, timeout)
        try:
            sock = jump.get_transport().open_channel("direct-tcpip", (target.hostname, target.port), ("", 0))
        except Exception as e:  # noqa: BLE001 - paramiko's ChannelException and friends
            jump.close()
            raise JobError(f"host {target.alias}: jump host {jump_alias} cannot reach "
                           f"{target.hostname}:{target.port}: {e}") from None
    client = paramiko.SSHClient()
    if os.path.exists(target.known_hosts):
        client.load_host_keys(target.known_hosts)
    client.set_missing_host_key_policy(_KeyPolicy(target, accept_new or target.strict in ("accept-new", "no")))
    known_name = target.hostname if target.port == 22 else f"[{target.hostname}]:{target.port}"
    try:
        client.connect(target.hostname, port=target.port, username=target.user, key_filename=target.identities or None,
                       allow_agent=True, look_for_keys=not target.identities, timeout=timeout, sock=sock)
    except JobError:
        raise
    except paramiko.BadHostKeyException:
        raise _host_key_error(target, accept_new, f"the host key has CHANGED since it was recorded in {target.known_hosts} "
                              f"(entry {known_name}); refusing to connect") from None
    except paramiko.AuthenticationException as e:
        raise JobError(f"host {target.alias}: authentication as {target.user} failed ({e})") from None
    except (OSError, paramiko.SSHException) as e:
        raise JobError(f"host {target.alias} ({target.hostname}:{target.port}) is unreachable: {e}") from None
    if sock is not None:
        client._monarch_jump = jump  # type: ignore[attr-defined]  # lives as long as the connection through it
    return client


def _run(client: Any, command: str, timeout: float = 60.0) -> Tuple[int, str]:
    _, out, err = client.exec_command(command, timeout=timeout)
    text = out.read().decode(errors="replace") + err.read().decode(errors="replace")
    return out.channel.recv_exit_status(), text


def _agent_command(python: str, directory: str, remote_root: str, target: SshTarget, preload: Optional[str]) -> str:
    q = shlex.quote
    agent = f"{python} -m monarch_cli.runtime.agent --address-file {q(directory + '/agent.addr')} " \
            f"--host {q(target.hostname)} --name {q(target.alias)} --warm-up"
    if preload is not None:
        agent += f" --preload {q(preload)}"
    env = (f"MONARCH_KEY_FILE={q(directory + '/keys')} MONARCH_HOST={q(target.hostname)} "
           f"MONARCH_REMOTE_DIR={q(remote_root)}")
    # Not `cd && agent &`: that backgrounds a subshell, whose pid $! would be, and which keeps
    # the SSH channel open. setsid does not fork here (a background job is no group leader).
    return (f"cd {q(directory)} || exit 1; {env} nohup setsid {agent} > {q(directory + '/agent.log')} 2>&1 < /dev/null & "
            f"echo $! > {q(directory + '/agent.pid')}")


class SshScheduler(Scheduler):
    name = "ssh"

    def default_hosts(self) -> Optional[int]:
        return None

    def plan(self, request: ReserveRequest, reservation_id: str = "<reservation>") -> List[Tuple[SshTarget, str, str]]:
        """Per host: (target, its directory, the agent command). No network."""
        opts = _options(request)
        names = host_names(opts)
        if request.hosts not in (1, len(names)):
            raise JobError(f"--hosts lists {len(names)} host(s) but {request.hosts} were asked for")
        python = opts.get("python") or "python3"
        root = (opts.get("remote_dir") or "~/.monarch-cli").rstrip("/")
        out = []
        for alias in names:
            target = resolve(alias, opts)
            directory = f"{root}/{reservation_id}"
            out.append((target, directory, _agent_command(python, directory, root, target, request.preload)))
        return out

    def dryrun(self, request: ReserveRequest, workdir: Path) -> DryRun:
        plan = self.plan(request)
        python = _options(request).get("python") or "python3"
        lines = []
        for target, directory, command in plan:
            lines += [f"# {target.alias}: {target.describe()} (keys: {', '.join(target.identities) or 'ssh-agent / defaults'}; "
                      f"known hosts: {target.known_hosts})",
                      f"check: {python} -c 'import monarch_cli; print(monarch_cli.__version__)'  (must print {__version__})",
                      f"upload: {directory}/keys  (0600 in a 0700 directory, over SFTP; the reservation's keys: <redacted>)",
                      f"run: {command}", ""]
        summary = (f"start a detached host agent on {len(plan)} SSH host(s) "
                   f"({', '.join(t.alias for t, _, _ in plan)}), set up in parallel")
        return DryRun(self.name, summary, {"hosts": "\n".join(lines).rstrip()})

    def reserve(self, request: ReserveRequest, keys: Keys, workdir: Path, progress: Progress) -> Reservation:
        reservation_id = f"ssh-{uuid.uuid4().hex[:8]}"
        plan = self.plan(request, reservation_id)
        opts = _options(request)
        accept_new = bool(opts.get("accept_new_host_keys"))
        python = opts.get("python") or "python3"
        started: Dict[int, Dict[str, Any]] = {}
        errors: List[str] = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(plan))) as pool:
            futures = {pool.submit(self._start_host, target, directory, python, request.preload, keys, accept_new,
                                   progress): i
                       for i, (target, directory, _) in enumerate(plan)}
            for fut in concurrent.futures.as_completed(futures):
                i = futures[fut]
                try:
                    started[i] = fut.result()
                except Exception as e:  # noqa: BLE001 - every host's failure is reported, then all are undone
                    errors.append(str(e) if isinstance(e, JobError) else f"host {plan[i][0].alias}: {type(e).__name__}: {e}")
        if errors:
            self._release_hosts([started[i] for i in sorted(started)])
            raise JobError(errors[0] + (f" (and {len(errors) - 1} more host(s) failed)" if len(errors) > 1 else ""))
        hosts = [HostRecord(name=plan[i][0].alias, agent=started[i]["address"], pid=started[i]["pid"], node_rank=i)
                 for i in range(len(plan))]
        return Reservation(reservation_id, hosts, {"ssh_hosts": [started[i] for i in range(len(plan))],
                                                   "accept_new_host_keys": accept_new})

    def _start_host(self, target: SshTarget, directory: str, python: str, preload: Optional[str], keys: Keys,
                    accept_new: bool, progress: Progress) -> Dict[str, Any]:
        progress(f"{target.alias}: connecting to {target.describe()}")
        client = connect(target, accept_new)
        record: Dict[str, Any] = {**dataclasses.asdict(target), "directory": directory, "pid": None, "address": ""}
        try:
            code, text = _run(client, f"{python} -c 'import monarch_cli; print(monarch_cli.__version__)'")
            version = text.strip().splitlines()[-1] if code == 0 and text.strip() else None
            if version != __version__:
                found = f"has monarch-cli {version}" if version else "has no monarch-cli (or no such interpreter)"
                raise JobError(f"host {target.alias}: {python} {found}, this client is {__version__}; install it there "
                               f"with: {python} -m pip install 'monarch-cli=={__version__}' (or pass --python)")
            sftp = client.open_sftp()
            try:
                home = sftp.normalize(".")
                path = home + directory[1:] if directory.startswith("~") else directory
                record["directory"] = path
                command = _agent_command(python, path, path.rpartition("/")[0], target, preload)
                _sftp_makedirs(sftp, path)
                sftp.chmod(path, 0o700)
                with sftp.open(f"{path}/keys", "w") as f:
                    f.chmod(0o600)  # before the secret is written
                    f.write(keys.encode().encode() + b"\n")
                progress(f"{target.alias}: starting the agent")
                code, text = _run(client, command)
                if code != 0:
                    raise JobError(f"host {target.alias}: could not start the agent: {text.strip()[-300:]}")
                record["pid"] = int(_read(sftp, f"{path}/agent.pid").strip())
                record["address"] = _wait_address(sftp, client, path, record["pid"], target)
            finally:
                sftp.close()
        except BaseException:
            if record["pid"] or record["directory"] != directory:
                _stop_host(client, record)
            client.close()
            raise
        client.close()
        progress(f"{target.alias} ready at {record['address']}")
        return record

    def can_serve(self, state: JobState, request: ReserveRequest) -> Optional[str]:
        why = super().can_serve(state, request)
        if why is None:
            names = host_names(_options(request))
            had = [r["alias"] for r in state.scheduler_data.get("ssh_hosts", [])]
            if names != had:
                return f"it has hosts {','.join(had)}, not {','.join(names)}"
        return why

    def release(self, state: JobState) -> None:
        self._release_hosts(state.scheduler_data.get("ssh_hosts", []),
                            bool(state.scheduler_data.get("accept_new_host_keys")))

    def _release_hosts(self, records: List[Dict[str, Any]], accept_new: bool = False) -> None:
        def one(rec: Dict[str, Any]) -> None:
            fields = {f.name for f in dataclasses.fields(SshTarget)}
            target = SshTarget(**{k: v for k, v in rec.items() if k in fields})
            try:
                client = connect(target, accept_new)
            except JobError:
                return  # unreachable: nothing more can be done from here
            try:
                _stop_host(client, rec)
            finally:
                client.close()

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(records)))) as pool:
            list(pool.map(one, records))

    def describe(self, state: JobState) -> Dict[str, Any]:
        return {"ssh": [{"host": r["alias"], "target": f"{r['user']}@{r['hostname']}:{r['port']}", "pid": r["pid"],
                         "directory": r["directory"]} for r in state.scheduler_data.get("ssh_hosts", [])]}


def _stop_host(client: Any, rec: Dict[str, Any]) -> None:
    """TERM the agent (it ends its ranks and procs), KILL its process group after 5 s, remove its directory."""
    q = shlex.quote
    pid = rec.get("pid")
    script = ""
    if pid:
        script += (f"kill -TERM {pid} 2>/dev/null; for i in $(seq 50); do kill -0 {pid} 2>/dev/null || break; sleep 0.1; done; "
                   f"kill -KILL -- -{pid} 2>/dev/null; kill -KILL {pid} 2>/dev/null; ")
    if rec.get("directory") and "~" not in rec["directory"]:
        script += f"rm -rf {q(rec['directory'])}"
    if script:
        _run(client, script, timeout=30)


def _sftp_makedirs(sftp: Any, path: str) -> None:
    parts = path.split("/")
    for i in range(2, len(parts) + 1):
        sub = "/".join(parts[:i])
        if not sub:
            continue
        try:
            sftp.stat(sub)
        except IOError:
            sftp.mkdir(sub, mode=0o700)


def _read(sftp: Any, path: str) -> str:
    with sftp.open(path, "r") as f:
        return f.read().decode()


def _wait_address(sftp: Any, client: Any, path: str, pid: int, target: SshTarget) -> str:
    from ..runtime.agent import READY_PREFIX

    deadline = time.monotonic() + _AGENT_TIMEOUT
    while time.monotonic() < deadline:
        try:
            return _read(sftp, f"{path}/agent.addr").strip().removeprefix(READY_PREFIX)
        except IOError:
            pass
        if _run(client, f"kill -0 {pid}")[0] != 0:
            try:
                log = _read(sftp, f"{path}/agent.log").strip().splitlines()
            except IOError:
                log = []
            raise JobError(f"host {target.alias}: the agent exited at start-up: {log[-1] if log else 'no log'}")
        time.sleep(0.2)
    raise JobError(f"host {target.alias}: the agent did not start within {_AGENT_TIMEOUT:.0f} s")
