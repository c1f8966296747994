"""Move requests: a file in the job's private run dir that asks the controller to move a
node's ranks onto a warm spare at a step boundary. `hpct-slurm move NODE JOB` writes one, and
so does a rank whose shared state diverged from its replicas' (recovery/crosscheck.py); the
controller reads them at its next Slurm poll (controller/lifecycle.py). Apart from both, so
that a rank writes one without importing the controller."""
from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from .errors import HpctError
from .rundir import as_owner, private_dir, write_private

# `hpct-slurm move NODE JOB` leaves a request file here, in the job's private run dir (0700:
# whoever can write there holds the job's secret already); the controller picks it up at its
# next Slurm poll.
REQUESTS = "requests"
# A request holds one reason of at most 200 characters (ask_move): anything much bigger is
# not one of ours, and is refused unread.
REQUEST_MAX_BYTES = 1024
# Read in the controller's loop: never block (a fifo), never follow a link, never a file the
# run dir's owner did not write as a request (a directory, a device).
_REQUEST_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
NODE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# What a rank's request says when its replicas disagreed with it (recovery/crosscheck.py):
# the controller drains such a node once its ranks have left, not only moves them
CORRUPTION = "silent data corruption"


def ask_move(run_dir: Path, node: str, reason: str) -> Path:
    """Leave a move request for the controller of the job whose run dir is `run_dir`."""
    if not NODE_NAME_RE.fullmatch(node):
        raise HpctError(f"node name {node!r} is not one node name")
    if not reason.strip() or not reason.isprintable() or len(reason) > 200:
        raise HpctError(f"move reason {reason!r:.60} is not one printable line of at most 200 "
                        f"characters")
    if not (run_dir / "secret").is_file():
        raise HpctError(f"{run_dir} is not a job's run dir (no secret file): pass --run-dir")

    def write() -> Path:
        d = private_dir(run_dir / REQUESTS, "requests dir")
        return write_private(d / f"move-{node}", reason.encode())
    # root's request (an admin's) is written as the job's user, who reads it and writes the
    # next ones beside it
    return as_owner(run_dir, write)


def read_request(f: Path) -> bytes:
    """What one request file holds; HpctError saying why when the entry is not a regular
    file of at most REQUEST_MAX_BYTES (a fifo froze the controller's loop; a link was
    followed)."""
    try:
        fd = os.open(f, _REQUEST_FLAGS)
    except OSError as exc:
        what = "a symlink (never followed)" if exc.errno == errno.ELOOP else \
            f"not openable ({exc.strerror})"
        raise HpctError(f"request {f.name} is {what}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            mode = stat.filemode(st.st_mode)
            what = {"p": "a fifo", "d": "a directory"}.get(mode[0], f"mode {mode}")
            raise HpctError(f"request {f.name} is not a regular file ({what})")
        data = os.read(fd, REQUEST_MAX_BYTES + 1)
        if st.st_size > REQUEST_MAX_BYTES or len(data) > REQUEST_MAX_BYTES:
            raise HpctError(f"request {f.name} holds {max(st.st_size, len(data))} bytes, more "
                            f"than the {REQUEST_MAX_BYTES} a request may")
        return data
    finally:
        os.close(fd)


def unreadable(d: Path, exc: OSError) -> str:
    """Why no request in `d` can be read, and what to do about it."""
    try:
        st = os.lstat(d)
        whose = f" (owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"
    except OSError:
        whose = ""
    return (f"requests dir {d} cannot be read ({exc.strerror}){whose}: no move request of "
            f"this job is seen, neither `hpct-slurm move`'s nor a rank's. Remove it as root "
            f"(`rm -r {d}`) and ask again")


def read_requests(run_dir: Path) -> list[tuple[Path, str, str, str]]:
    """The move requests waiting: (file, node, reason, refused). Malformed ones have an
    empty reason, so they are answered (move.skipped) rather than retried forever; `refused`
    says why an entry was not read at all (move.request_refused). HpctError when the
    requests dir itself cannot be listed (`unreadable`)."""
    d = run_dir / REQUESTS
    try:
        names = sorted(n for n in os.listdir(d) if n.startswith("move-"))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:  # a glob would see nothing and say nothing
        raise HpctError(unreadable(d, exc)) from None
    out = []
    for f in (d / n for n in names):
        node = f.name[len("move-"):]
        reason = refused = ""
        try:
            reason = read_request(f).decode()[:200]
        except UnicodeDecodeError:
            pass
        except HpctError as exc:
            refused = exc.message
        if not reason.isprintable() or not NODE_NAME_RE.fullmatch(node):
            reason = ""
        out.append((f, node, reason, refused))
    return out
