"""The per-node shm root and its per-job directories, touched only through directory fds.

Layout under the root (default /dev/shm/hpct, owned by root, mode 0755):
    <jobid>/          the job's cache dir, owned by the job's user, mode 0700
    <jobid>.budget    the MB the prolog granted that job (root-owned; read by the task prolog)
    .lock             flock'ed by a prolog (sweep + grant + budget write) and an epilog, so
                      two jobs starting on one node cannot both be granted the same MB
Nothing else in the root is ever touched. Every operation works relative to an fd of the root
opened with O_NOFOLLOW, and removal walks directories by fd, so a symlink planted anywhere
(the root, a job dir, inside a job dir) is removed as a link and never followed. Removal is
iterative with a bounded number of fds, however deep a job's user nests directories.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

from ..errors import HpctError, shown
# One job id rule for the hooks, the tasks and `hpct-slurm env` (re-exported from here).
from .. import config as C
from ..slurm.env import JOB_ID_RE, check_job_id

DEFAULT_SHM_ROOT = Path(C.BY_NAME[C.SHM_ROOT].default)
SHM_ROOT_ENV = C.SHM_ROOT
BUDGET_SUFFIX = ".budget"
LOCK_NAME = ".lock"

# A single path component: no separators, no leading dot (so never '.' or '..').
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_name(value: str, what: str = "cache name") -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise HpctError(f"{what} {value!r} is not a plain name (letters, digits, '._-', "
                        f"at most 64, not starting with '.')")
    return value


def shm_root(environ: Mapping[str, str]) -> Path:
    raw = C.read(environ, C.SHM_ROOT)
    path = Path(raw)
    if not path.is_absolute() or ".." in path.parts or path == Path("/"):
        raise HpctError(f"{SHM_ROOT_ENV} {raw!r} is not an absolute directory path")
    return path


@dataclass(frozen=True)
class JobDirInfo:
    path: Path
    uid: int
    gid: int
    mode: int
    replaced: bool  # an entry that was not the job's own directory stood there


def _planted(path: Path, parent_fd: int) -> str:
    """Why the entry at `path` cannot be the shm root, saying what it is and whose: the node is
    drained with this line, and an admin must be able to tell a planted trap from a mistake."""
    try:
        st = os.stat(path.name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError as exc:
        return f"shm root {path} cannot be examined ({exc.strerror}): remove it"
    if stat.S_ISLNK(st.st_mode):
        try:
            what = f"a symlink to {shown(os.readlink(path.name, dir_fd=parent_fd), 200)}"
        except OSError:
            what = "a symlink"
    else:
        what = _KINDS.get(stat.S_IFMT(st.st_mode), "an unknown kind of file")
    try:
        owner = f"uid {st.st_uid} ({pwd.getpwuid(st.st_uid).pw_name})"
    except KeyError:
        owner = f"uid {st.st_uid}"
    return (f"shm root {path} is {what} owned by {owner} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}, not a directory owned by uid {os.geteuid()} "
            f"that only it can write: it was there before the prolog made it (the hooks never "
            f"follow or reuse it); find out who made it, remove it (rm -r {path}) and resume "
            f"the node")


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFREG: "a regular file", stat.S_IFIFO: "a fifo",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device"}


class ShmRoot:
    """An open handle on the shm root. Use as a context manager."""

    def __init__(self, path: Path, create: bool = False):
        self.path = path
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if create:
                try:
                    os.mkdir(path.name, 0o755, dir_fd=parent)
                except FileExistsError:
                    pass
            try:
                self.fd = os.open(path.name, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                raise HpctError(f"shm root {path} does not exist") from None
            except OSError:
                raise HpctError(_planted(path, parent)) from None
            st = os.fstat(self.fd)
            # Anyone who could write into the root could plant entries the prolog then chowns.
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                os.close(self.fd)
                raise HpctError(_planted(path, parent))
        finally:
            os.close(parent)
        if create and stat.S_IMODE(st.st_mode) != 0o755:
            os.fchmod(self.fd, 0o755)

    def __enter__(self) -> "ShmRoot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold an exclusive flock on `<root>/.lock` (created if missing) for the block. The
        lock file is opened relative to the root's fd with O_NOFOLLOW, never through a link,
        and must be a plain file."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(LOCK_NAME, flags, 0o600, dir_fd=self.fd)
        except OSError as exc:
            raise HpctError(f"lock file {self.path / LOCK_NAME} cannot be opened "
                            f"({exc.strerror}): remove it") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise HpctError(f"lock file {self.path / LOCK_NAME} is not a plain file: "
                                f"remove it")
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # ---- reading -----------------------------------------------------------------------
    def job_ids(self) -> set[int]:
        """Jobs with a dir or a budget record here; other entries are not ours to judge."""
        ids = set()
        for name in os.listdir(self.fd):
            base = name[:-len(BUDGET_SUFFIX)] if name.endswith(BUDGET_SUFFIX) else name
            if JOB_ID_RE.fullmatch(base):
                ids.add(int(base))
        return ids

    def budgets_mb(self) -> dict[int, int]:
        out = {}
        for job_id in self.job_ids():
            mb = self.read_budget(job_id)
            if mb is not None:
                out[job_id] = mb
        return out

    def read_budget(self, job_id: int) -> int | None:
        return _read_budget(self.fd, job_id)

    def capacity_mb(self) -> int:
        st = os.fstatvfs(self.fd)
        return st.f_blocks * st.f_frsize // (1 << 20)

    def free_mb(self) -> int:
        st = os.fstatvfs(self.fd)
        return st.f_bavail * st.f_frsize // (1 << 20)

    # ---- acting ------------------------------------------------------------------------
    def create_job_dir(self, job_id: int, uid: int, gid: int) -> JobDirInfo:
        """The job's dir, owned by uid:gid, mode 0700. A requeued job finds its own dir (and
        its warm cache) again; any other entry under that name is removed first."""
        name = str(check_job_id(job_id))
        replaced = False
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                self._remove_entry(name)
                replaced = True
        except FileNotFoundError:
            pass
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
        except FileExistsError:
            pass
        fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        try:
            os.fchown(fd, uid, gid)
            os.fchmod(fd, 0o700)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return JobDirInfo(self.path / name, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode),
                          replaced)

    def write_budget(self, job_id: int, mb: int) -> None:
        name = f"{check_job_id(job_id)}{BUDGET_SUFFIX}"
        tmp = f".{name}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=self.fd)
        with os.fdopen(fd, "w") as f:
            f.write(f"{int(mb)}\n")
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove_job(self, job_id: int) -> bool:
        """Remove the job's dir and budget record; True if anything was there."""
        name = str(check_job_id(job_id))
        found = False
        for entry in (name, name + BUDGET_SUFFIX):
            try:
                self._remove_entry(entry)
                found = True
            except FileNotFoundError:
                pass
        return found

    def _remove_entry(self, name: str) -> None:
        remove_tree_at(self.fd, name)


# A directory found refilled this many times while we empty it is left for the next sweep.
_MAX_SCANS = 3


@dataclass
class _Level:
    """A directory on the way down: its name in its parent, its (st_dev, st_ino), and the
    subdirectories still to empty."""

    name: str
    ident: tuple[int, int]
    pending: list[str] = field(default_factory=list)
    scans: int = 0


def _open_subdir(dir_fd: int, name: str) -> int | None:
    """`name` opened as a directory, never through a symlink; a symlink or any other
    non-directory is unlinked as itself instead (None)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    os.unlink(name, dir_fd=dir_fd)
    return None


def _scan(fd: int) -> list[str]:
    """Unlink every entry of directory `fd` that is not a directory; the names of those that
    are."""
    subdirs = []
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
                continue
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except IsADirectoryError:  # swapped for a directory since the listing
                subdirs.append(entry.name)
    return subdirs


def remove_tree_at(dir_fd: int, name: str) -> None:
    """rm -r of one entry relative to dir_fd, never following a symlink; FileNotFoundError if
    there is none.

    Iterative with at most two directory fds open at a time, however deep the tree: the job's
    user decides how deep a job dir goes, and a recursive walk (one frame and one fd a level)
    let 1,100 nested dirs kill the epilog with a RecursionError. It climbs back up through
    '..' and checks that it arrived in the very directory it came down from, so a directory
    moved away mid-walk cannot lead it out of the tree. The user may also swap entries while
    we walk: O_NOFOLLOW makes a swapped-in symlink fail to open, and it is then unlinked as
    the link it is. Raises HpctError (and leaves the rest in place) for a mount point, a
    directory moved mid-walk, or one refilled faster than it is emptied."""
    fd = _open_subdir(dir_fd, name)
    if fd is None:
        return
    top_dev = os.fstat(dir_fd).st_dev
    try:
        st = os.fstat(fd)
        # Same device only: a mount inside a job dir is not ours to empty.
        if st.st_dev != top_dev:
            raise HpctError(f"refusing to remove {name}: it is a mount point")
        levels = [_Level(name, (st.st_dev, st.st_ino))]
        while levels:
            level = levels[-1]
            if level.pending:  # go down into the next subdirectory
                sub = level.pending.pop()
                try:
                    child = _open_subdir(fd, sub)
                except FileNotFoundError:
                    continue
                if child is None:
                    continue
                st = os.fstat(child)
                if st.st_dev != top_dev:
                    os.close(child)
                    raise HpctError(f"refusing to remove {name}: {sub} in it is a mount point")
                os.close(fd)
                fd = child
                levels.append(_Level(sub, (st.st_dev, st.st_ino)))
                continue
            if level.scans == _MAX_SCANS:
                raise HpctError(f"gave up removing {name}: a directory in it is refilled "
                                f"while it is being emptied")
            level.scans += 1
            level.pending = _scan(fd)
            if level.pending:
                continue
            levels.pop()  # this level is empty: climb to its parent and remove it
            if not levels:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != levels[-1].ident:
                raise HpctError(f"gave up removing {name}: a directory in it was moved while "
                                f"it was being removed")
            os.rmdir(level.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _read_budget(dir_fd: int, job_id: int) -> int | None:
    name = f"{check_job_id(job_id)}{BUDGET_SUFFIX}"
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        text = f.read(32).strip()
    return int(text) if text.isdecimal() else None


def read_budget(root: Path, job_id: int) -> int | None:
    """The MB the prolog granted a job, read without privileges (the task prolog runs as the
    job's user); None when no prolog granted one."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return None
    try:
        return _read_budget(fd, job_id)
    finally:
        os.close(fd)


def job_dir(environ: Mapping[str, str]) -> Path:
    """The shm dir of the job this process belongs to."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        raise HpctError("SLURM_JOB_ID is not set: not inside a Slurm job, so there is no "
                        "per-job shm dir (pass the cache a directory instead)")
    return shm_root(environ) / str(check_job_id(job, "SLURM_JOB_ID"))
