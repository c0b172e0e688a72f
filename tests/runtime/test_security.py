"""Pickles are code: only holders of the reservation keys may reach any socket."""

from __future__ import annotations

import os
import pickle
import time

import psutil
import pytest
import zmq

from monarch_cli import Actor, HostMesh, endpoint, this_host
from monarch_cli.runtime.mailbox.mailbox import Mailbox
from monarch_cli.runtime.transport.keys import Keys


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class Plain(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _attack(address: str, frames: list, curve_keys: Keys | None, server_public: bytes | None) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if curve_keys is not None:
        sock.curve_serverkey = server_public
        sock.curve_publickey = curve_keys.public
        sock.curve_secretkey = curve_keys.secret
    sock.connect(address)
    sock.send_multipart(frames)
    time.sleep(0.5)
    ctx.destroy(linger=0)


@pytest.mark.parametrize("attacker", ["plain", "wrong-keys-but-known-server-key"])
def test_crafted_pickle_from_an_unauthenticated_peer_runs_nothing(tmp_path, agents, attacker):
    procs = HostMesh.connect(agents[:1]).spawn_procs(per_host={"n": 1})
    proc = procs._members[0]
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(str(marker)))
    mb = Mailbox.get()
    # The worst case gives the attacker the server's public key; it still lacks the secret.
    curve = Keys.generate() if attacker != "plain" else None
    messages = {
        proc.inbox: [pickle.dumps(("spawn", 1, mb.address, "x", "x", None)), evil],
        agents[0]: [pickle.dumps(("spawn_procs", 1, mb.address)), evil],
        mb.address: [pickle.dumps(("result", 1, True)), evil],
    }
    for address, frames in messages.items():
        _attack(address, [evil] if attacker == "plain" else frames, curve, mb.keys.public)
    assert not marker.exists(), "an unauthenticated peer got code executed"
    # Everything still works for the key holder.
    assert procs.spawn("plain", Plain).pid.call_one().get(timeout=10) == proc.pid
    procs.stop().get()


def test_keys_never_appear_on_a_command_line_or_in_proc_environments():
    procs = this_host().spawn_procs(per_host={"n": 2})
    secret = Mailbox.get().keys.secret.decode()
    runtime = [
        p
        for p in psutil.process_iter(["cmdline"])
        if " ".join(p.info["cmdline"] or []).startswith(("monarch agent ", "monarch proc ", "monarch fork-server "))
    ]
    pids = {p.pid for p in procs._members}
    assert runtime
    for p in runtime:
        assert secret not in " ".join(p.cmdline())
    for pid in pids:
        environ = psutil.Process(pid).environ()
        assert "MONARCH_KEYS" not in environ and secret not in " ".join(environ.values())
    procs.stop().get()


def test_key_files_must_be_private(tmp_path):
    keys = Keys.generate()
    path = tmp_path / "keys"
    keys.write(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert Keys.read(path) == keys
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="readable by others"):
        Keys.read(path)
    with pytest.raises(ValueError, match="malformed"):
        Keys.decode("not keys")
    assert keys.secret.decode() not in repr(keys)
