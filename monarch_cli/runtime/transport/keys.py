"""Reservation keys: one CURVE key pair that every process of a reservation holds.

Whoever holds the pair can make the runtime run code, so it is passed through a 0600
file, an environment variable or a pipe, never on a command line.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import zmq
from zmq.utils import z85

from ... import config

KEY_ENV = config.KEYS_ENV
KEY_FILE_ENV = config.KEY_FILE_ENV


@dataclasses.dataclass(frozen=True)
class Keys:
    public: bytes  # z85, 40 bytes
    secret: bytes

    @classmethod
    def generate(cls) -> Keys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def encode(self) -> str:
        return f"{self.public.decode()} {self.secret.decode()}"

    @classmethod
    def decode(cls, text: str) -> Keys:
        try:
            public, secret = text.strip().split(" ")  # z85 has no space
            if len(public) != 40 or len(secret) != 40:
                raise ValueError
            z85.decode(public)
            z85.decode(secret)
        except Exception:  # noqa: BLE001
            raise ValueError("malformed reservation keys") from None
        return cls(public.encode(), secret.encode())

    def __repr__(self) -> str:  # never print the secret
        return f"Keys(public={self.public.decode()!r})"

    def write(self, path: Path) -> None:
        """Write to ``path`` with mode 0600 from the start (no window where it is readable)."""
        from ...sysutil import atomic_write

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, self.encode(), 0o600)

    @classmethod
    def read(cls, path: Path) -> Keys:
        mode = os.stat(path).st_mode
        if mode & 0o077:
            raise PermissionError(f"{path} is readable by others (mode {oct(mode & 0o777)}); expected 0600")
        return cls.decode(Path(path).read_text())


def keys_from_environment() -> Keys | None:
    """Keys handed down by a parent: ``$MONARCH_KEYS`` (removed once read) or ``$MONARCH_KEY_FILE``."""
    text = os.environ.pop(KEY_ENV, None)
    if text:
        return Keys.decode(text)
    path = os.environ.get(KEY_FILE_ENV)
    if path:
        return Keys.read(Path(path))
    return None
