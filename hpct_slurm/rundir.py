"""The run directory is private to the job's user, and nothing already in it is trusted.

Whoever can write into a job's run dir can run code as the job's user (the controller submits
`companion.sbatch` from it) and hand the job a training state (persisted snapshots). So:

* the run dir and its subdirectories are created 0700, whatever the umask or a setgid parent
  would make of them (umask 002 in a 2775 group dir gave 2775);
* an existing one is used only if it is a real directory (not a symlink) owned by this user
  and writable by no one else, otherwise HpctError naming the path and its mode;
* files are written under a fresh temporary name (O_CREAT|O_EXCL|O_NOFOLLOW: never an existing
  file, never through a planted link) and renamed into place.

Another user cannot rename or replace a directory they cannot write to, so a 0700 run dir
stays ours even inside a group-writable parent.
"""
from __future__ import annotations

import contextlib
import errno
import os
import pwd
import secrets
import stat
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from .errors import HpctError, describe

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def private_dir(path: str | os.PathLike, what: str = "run dir") -> Path:
    """`path` as a directory that only this user can write: created 0700 if missing (its
    parents as usual), or an existing one checked. `what` names it in errors."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise HpctError(f"{what} {path} cannot be opened ({exc.strerror})") from None
        kind = "a symlink" if os.path.islink(path) else "not a directory"
        raise HpctError(f"{what} {path} is {kind}: give the path of a real directory (a link "
                        f"could be pointed elsewhere by whoever owns it)") from None
    try:
        st = os.fstat(fd)
        if created:
            # mkdir's mode is cut by the umask and a setgid parent adds S_ISGID: set it exactly.
            os.fchmod(fd, 0o700)
        elif st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise HpctError(
                f"{what} {path} is owned by uid {st.st_uid} with mode "
                f"{stat.S_IMODE(st.st_mode):04o}; it must be owned by you (uid {os.geteuid()}) "
                f"and not be writable by group or others, since whoever can write there can "
                f"plant scripts and snapshots that this job then runs as you. Check what is "
                f"in it and `chmod go-w {path}`, or use another run dir (--run-dir)")
    finally:
        os.close(fd)
    return path


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mode: int = 0o600,
              durable: bool = False) -> Iterator[BinaryIO]:
    """A binary file that becomes `path` when the block succeeds (and is removed when it
    fails). It is written under a fresh temporary name in the same directory, opened
    O_CREAT|O_EXCL|O_NOFOLLOW, so neither a file nor a link already there is ever written
    through; the rename then replaces whatever `path` was, a link as the link. `durable`:
    fsync the file and the directory first, so a crash leaves the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)  # make the rename itself durable
        finally:
            os.close(dfd)


def write_private(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> Path:
    """Replace `path` with a new file holding `data` (see `replacing`)."""
    with replacing(path, mode) as f:
        f.write(data)
    return Path(path)


def as_owner(path: str | os.PathLike, write: Callable[[], Path]) -> Path:
    """`write()`, run as the owner of the directory `path` when root calls it for another
    user (an admin acting on a user's job), else as the caller. What root would create there
    is root's, 0700: the owner could neither read it nor write beside it again. In a child
    that drops to the owner's uid, its primary group and no others, so root never follows
    a path the owner controls. The path `write` wrote, or HpctError saying why it failed."""
    st = os.stat(path)  # the directory written into, where `path` is a link to it
    if os.geteuid() != 0 or st.st_uid == 0:
        return write()
    try:
        gid = pwd.getpwuid(st.st_uid).pw_gid
    except KeyError:
        gid = st.st_gid  # a uid without a passwd entry: the directory's group
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        os.close(rfd)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(st.st_uid)
            out = "ok\0" + str(write())
        except BaseException as exc:  # noqa: BLE001 - told to the parent, never raised here
            out = "error\0" + describe(exc)
        os.write(wfd, out.encode()[:4096])  # one write a pipe takes whole
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        out = r.read().decode()
    os.waitpid(pid, 0)
    kind, _, text = out.partition("\0")
    if kind != "ok":
        raise HpctError(text or f"writing as uid {st.st_uid} (the owner of {path}) failed")
    return Path(text)
