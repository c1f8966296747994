"""The per-job secret file: created owner-only and never reused, refused when others could read
it. The same secret keys the control protocol, the transfer servers, the rendezvous store and
the persisted snapshots' MACs."""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from ..errors import HpctError

SECRET_BYTES = 32


def new_secret_file(path: str | os.PathLike) -> bytes:
    """Create `path` holding a fresh secret (hex), readable by the owner only; returns it.

    O_EXCL: an existing file (maybe planted by someone else) is an error, never reused.
    """
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise HpctError(f"secret file '{path}' already exists; remove it or use another path") from None
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret


def load_secret(path: str | os.PathLike) -> bytes:
    """Read a secret written by `new_secret_file`, refusing a file others could read."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise HpctError(f"secret file '{p}' does not exist") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise HpctError(f"secret file '{p}' has mode {stat.S_IMODE(st.st_mode):04o}; "
                        f"it must not be group/other accessible (chmod 600 '{p}')")
    if st.st_uid != os.getuid():
        raise HpctError(f"secret file '{p}' is owned by uid {st.st_uid}, not by you ({os.getuid()})")
    text = p.read_text().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise HpctError(f"secret file '{p}' does not hold a hex secret") from None
    if len(secret) < 16:
        raise HpctError(f"secret in '{p}' is {len(secret)} bytes; at least 16 are needed")
    return secret
