"""What a host runs of the bundle (stdlib only, Python 3.6 syntax): the probe and the unpacker.

A part's name carries its content hash (:func:`tree_digest` over the files it unpacks to), so a
host checks every part against its name, whoever put it there: the unpacker verifies a part it
unzips before it renames it into place, and a part it already holds before it is used again.
A part that does not hold what its name says, or holds something not ours, is replaced, or
refused when it cannot be removed; it is never imported. The probe makes the remote directory
and ``bundles/`` 0700 and refuses them (one line) when another user could change or swap what is
in ``bundles/``: it is not ours or others can write it, or the remote directory or one above it
is neither ours nor root's, or others can write it and it is not sticky as ``/tmp`` is.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

#: Bump when the layout of a part changes: it is part of every hash.
FORMAT = "2"
#: Hex digits of a part's content hash in its name.
HASH_LENGTH = 32
#: Seconds after which an interrupted upload's zip or unpack directory counts as left behind.
STALE_SECONDS = 600
#: What the unpacker exits with when a held part failed its check (and was removed): ship it.
MISSING_STATUS = 3


def tree_digest(files: dict[str, bytes]) -> str:
    """The content hash of a part: ``files`` maps each path in it to its content's sha256 digest.
    The host computes the same over what it unpacked (:data:`UNPACK_SCRIPT`'s ``digest``)."""
    h = hashlib.sha256(FORMAT.encode())
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name])
    return h.hexdigest()[:HASH_LENGTH]


_PRIVATE = r"""
def _who(uid):
    try:
        import pwd
        return "%s (uid %d)" % (pwd.getpwuid(uid).pw_name, uid)
    except (ImportError, KeyError):
        return "uid %d" % uid

def _above(path):
    out = []
    while True:
        out.append(path)
        if os.path.dirname(path) == path:
            return out
        path = os.path.dirname(path)

def private(root, inner):
    # Make root and root/inner (0700, and missing parents); "" if nobody else can change what is in
    # root/inner or swap it, else one line saying why not. root and the directories above it may be
    # shared only as /tmp is (ours or root's, sticky where others may write); root/inner is ours alone.
    uid, leaf = os.geteuid(), os.path.join(root, inner)
    try:
        missing = [q for q in _above(leaf) if not os.path.lexists(q)]
        for q in reversed(missing):
            os.mkdir(q, 0o700)
        return _check(uid, root, leaf)
    except OSError as e:
        return "cannot make %s private: %s" % (leaf, e.strerror or e)

def _check(uid, root, leaf):
    for p in _above(root) + _above(os.path.realpath(root)):
        st = os.lstat(p)
        if st.st_uid not in (uid, 0):
            return "refusing %s: %s owns it and could swap what is below it; use a --remote-dir of your own" % (
                p, _who(st.st_uid))
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return "refusing %s: others can write it (mode %o) and swap what is below it; use a --remote-dir " \
                   "of your own" % (p, stat.S_IMODE(st.st_mode))
    st = os.lstat(leaf)
    if stat.S_ISLNK(st.st_mode) and st.st_uid in (uid, 0):
        st = os.stat(leaf)
    if not stat.S_ISDIR(st.st_mode):
        return "refusing %s: not a directory (a link or something else); remove it" % leaf
    if st.st_uid != uid:
        return "refusing %s: it was made by %s, not by you (%s); remove it or use another --remote-dir" % (
            leaf, _who(st.st_uid), _who(uid))
    if st.st_mode & 0o022:
        return "refusing %s: others can write it (mode %o); remove it or use another --remote-dir" % (
            leaf, stat.S_IMODE(st.st_mode))
    return ""
"""

#: ``python -c PROBE_SCRIPT BUNDLES_DIR``: makes the remote directory and ``bundles/`` private (or
#: says why it will not), then prints what the client needs about the interpreter and the parts
#: held, as one JSON line. Python 3.6 syntax on purpose: a too-old interpreter must still answer.
PROBE_SCRIPT = (
    r"""
import json, os, platform, stat, sys, sysconfig
d = os.path.abspath(os.path.expanduser(sys.argv[1]))
"""
    + _PRIVATE
    + r"""
unsafe = private(os.path.dirname(d), os.path.basename(d))
try:
    held = [] if unsafe else sorted(n for n in os.listdir(d) if n.startswith(("code-", "deps-")) and "." not in n)
except OSError:
    held = []
libc, libc_version = platform.libc_ver()
p = d
while not os.path.exists(p):
    p = os.path.dirname(p) or "/"
s = os.statvfs(p)
print(json.dumps({"free": s.f_bavail * s.f_frsize, "python": list(sys.version_info[:3]), "implementation": sys.implementation.name,
    "machine": platform.machine(), "system": platform.system(), "libc": libc, "libc_version": libc_version,
    "platform": sysconfig.get_platform(), "executable": sys.executable, "held": held, "unsafe": unsafe,
    "ssh_connection": os.environ.get("SSH_CONNECTION", "")}))
"""
)

#: ``python -c UNPACK_SCRIPT BUNDLES_DIR KEEP ARG...``: each ``PART.<anything>.zip`` becomes the
#: directory of its part (unzipped aside, checked against the part's name, then renamed into place;
#: a part already there that holds what its name says is kept); each bare ``PART`` is checked where
#: it is, and removed when it fails (then the script prints ``MISSING PART...`` and exits
#: :data:`MISSING_STATUS`: the client ships it). Zips uploaded into BUNDLES_DIR are removed; so are
#: an interrupted upload's leftovers older than :data:`STALE_SECONDS`, and the oldest parts beyond
#: KEEP of each kind. Stdlib only.
UNPACK_SCRIPT = (
    (
        r"""
import hashlib, os, shutil, stat, sys, time, zipfile
d, keep, args = os.path.expanduser(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
uid = os.geteuid()

def _raise(e):
    raise e

def digest(top):
    # The content hash carried by the name of the part; None if anything in it is not ours, or not
    # a plain file or directory. The caches of Python (__pycache__) are not part of it.
    files = []
    for root, dirs, names in os.walk(top, onerror=_raise):
        for n in dirs + names:
            p = os.path.join(root, n)
            st = os.lstat(p)
            if st.st_uid != uid or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                return None
            rel = os.path.relpath(p, top).replace(os.sep, "/")
            if stat.S_ISREG(st.st_mode) and "__pycache__" not in rel.split("/"):
                files.append(rel)
    h = hashlib.sha256(b"__FORMAT__")
    for rel in sorted(files):
        f = hashlib.sha256()
        with open(os.path.join(top, rel), "rb") as src:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                f.update(chunk)
        h.update(os.fsencode(rel) + b"\0" + f.digest())
    return h.hexdigest()[:__LENGTH__]

def holds(path, part):
    try:
        st = os.lstat(path)
        return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and digest(path) == part.split("-", 1)[1]
    except OSError:
        return False

def remove(path):
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
    except OSError as e:
        sys.exit("monarch: %s does not hold what its name says and cannot be removed (%s); remove it" % (
            path, e.strerror or e))

def unzip(z, tmp):
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp, 0o700)
    with zipfile.ZipFile(z) as f:
        for info in f.infolist():
            path = f.extract(info, tmp)
            mode = (info.external_attr >> 16) & 0o755
            os.chmod(path, 0o755 if info.is_dir() else (mode or 0o644))
    os.chmod(tmp, 0o755)

def install(z):
    z = os.path.join(d, z)
    part = os.path.basename(z).split(".")[0]
    final, tmp = os.path.join(d, part), os.path.join(d, part + ".tmp%d" % os.getpid())
    if not holds(final, part):
        unzip(z, tmp)
        if not holds(tmp, part):
            shutil.rmtree(tmp, ignore_errors=True)
            sys.exit("monarch: the zip of %s does not hold what its name says (damaged on the way?)" % part)
        remove(final)
        try:
            os.rename(tmp, final)
        except OSError:  # another unpack of the same part came first: it must hold the same
            shutil.rmtree(tmp, ignore_errors=True)
            if not holds(final, part):
                sys.exit("monarch: %s does not hold what its name says" % final)
    if os.path.dirname(os.path.abspath(z)) == os.path.abspath(d):
        os.unlink(z)
    return final

missing = []
for a in args:
    if a.endswith(".zip"):
        final = install(a)
    else:
        final = os.path.join(d, a)
        if not holds(final, a):
            remove(final)
            missing.append(a)
            continue
    os.utime(final)
named, now = set(os.path.basename(a) for a in args), time.time()
for n in os.listdir(d):
    p = os.path.join(d, n)
    if n.startswith(("code-", "deps-")) and "." in n and n not in named:
        st = os.lstat(p)
        if st.st_uid == uid and now - st.st_mtime > __STALE__:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
for kind in ("code-", "deps-"):
    parts = [os.path.join(d, n) for n in os.listdir(d) if n.startswith(kind) and "." not in n]
    parts.sort(key=os.path.getmtime, reverse=True)
    for old in parts[keep:]:
        shutil.rmtree(old, ignore_errors=True)
if missing:
    print("MISSING " + " ".join(missing))
    sys.exit(__MISSING__)
"""
    )
    .replace("__FORMAT__", FORMAT)
    .replace("__LENGTH__", str(HASH_LENGTH))
    .replace("__STALE__", str(STALE_SECONDS))
)
UNPACK_SCRIPT = UNPACK_SCRIPT.replace("__MISSING__", str(MISSING_STATUS))


def probe_command(python: str, bundles_shell: str) -> str:
    return f"{python} -c {shlex.quote(PROBE_SCRIPT)} {bundles_shell}"


def unpack_command(python: str, bundles_shell: str, keep: int, args: list[str]) -> str:
    """Unpack the zips in ``args`` and check the parts named bare there (see :data:`UNPACK_SCRIPT`)."""
    return f"{python} -c {shlex.quote(UNPACK_SCRIPT)} {bundles_shell} {keep} {shlex.join(args)}"


def failed_parts(text: str) -> list[str]:
    """The parts the unpacker removed because they did not hold what their names say."""
    for line in text.splitlines():
        if line.startswith("MISSING "):
            return line.split()[1:]
    return []


def parse_probe(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


__all__ = [
    "FORMAT",
    "HASH_LENGTH",
    "MISSING_STATUS",
    "PROBE_SCRIPT",
    "UNPACK_SCRIPT",
    "failed_parts",
    "parse_probe",
    "probe_command",
    "tree_digest",
    "unpack_command",
]
