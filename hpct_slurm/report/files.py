"""Reading a run dir's logs for `status` and `report` without trusting what stands there
(issue 45.3): whoever runs as the job's user can put anything under the run dir, and an admin
may read it as root.

* Nothing is followed out of the run dir: `events/` and every log are opened O_NOFOLLOW
  relative to the directory above them, so a symbolic link (to /dev/zero, to /etc/shadow, to
  another user's file) is named and skipped, never read.
* Only regular files are read: each log is opened O_NONBLOCK (a FIFO then never blocks the
  open) and checked with fstat after the open, so a FIFO, a device or a socket is skipped.
* Sizes are bounded: of a log over READ_CAP bytes only its first and last READ_CAP / 2 are
  read (where the run starts and where it stands now), and a warning says how much was left
  out.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Iterator

from ..errors import HpctError

READ_CAP = 64 * 1024 * 1024  # bytes read of one log at most
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR = _OPEN | os.O_DIRECTORY


@contextlib.contextmanager
def run_dir_fd(run_dir: Path) -> Iterator[int]:
    """The run dir, open (the path as given: the caller chose it)."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise HpctError(f"run dir {str(run_dir)!r} cannot be opened ({exc.strerror})") from None
    try:
        yield fd
    finally:
        os.close(fd)


def read_log(dir_fd: int, name: str, where: str,
             cap: int | None = None) -> tuple[str | None, list[str]]:
    """The text of the log `name` in the directory `dir_fd` (at most `cap` bytes of it, its
    first and last halves; READ_CAP unless given), and warning lines; None when it is not
    read (a warning says why). `where` names it in warnings."""
    cap = READ_CAP if cap is None else cap
    try:
        fd = os.open(name, _OPEN, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, [f"{where} is a symbolic link: not followed, not read"]
        return None, [f"{where} cannot be opened ({exc.strerror}): not read"]
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, [f"{where} is not a regular file ({_kind(st.st_mode)}): not read"]
        if st.st_size <= cap:
            return _pread(fd, cap, 0).decode("utf-8", errors="replace"), []
        half = cap // 2
        head = _pread(fd, half, 0)
        tail = _pread(fd, half, st.st_size - half)
        # cut at whole lines: the records on either side of a cut are left out with the middle
        head, tail = head[:head.rfind(b"\n") + 1], tail[tail.find(b"\n") + 1:]
        text = (head + tail).decode("utf-8", errors="replace")
        return text, [f"{where} is {st.st_size / 2**20:.0f} MiB, over the {cap / 2**20:.0f} "
                      f"MiB read of a log: only its first and last {half / 2**20:.0f} MiB "
                      f"were read, the {(st.st_size - len(head) - len(tail)) / 2**20:.0f} "
                      f"MiB between left out"]
    finally:
        os.close(fd)


def _pread(fd: int, n: int, offset: int) -> bytes:
    """Up to `n` bytes from `offset` (fewer at the end of the file)."""
    parts = []
    while n > 0:
        chunk = os.pread(fd, min(n, 1 << 20), offset)
        if not chunk:
            break
        parts.append(chunk)
        n -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def rank_logs(run_fd: int) -> tuple[dict[str, str], list[str]]:
    """Every `events/*.jsonl` (stem -> text) and warning lines. `events` itself is opened
    without following a link."""
    try:
        events_fd = os.open("events", _DIR, dir_fd=run_fd)
    except FileNotFoundError:
        return {}, []
    except OSError as exc:
        # O_DIRECTORY|O_NOFOLLOW on a link fails with ENOTDIR (Linux) or ELOOP
        link = exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
            os.stat("events", dir_fd=run_fd, follow_symlinks=False).st_mode)
        why = "a symbolic link: not followed" if link else \
            "not a directory" if exc.errno == errno.ENOTDIR else exc.strerror
        return {}, [f"events/ is {why}: no rank log read"]
    texts: dict[str, str] = {}
    warnings: list[str] = []
    try:
        for name in sorted(os.listdir(events_fd)):
            if not name.endswith(".jsonl"):
                continue
            text, said = read_log(events_fd, name, f"events/{name}")
            warnings += said
            if text is not None:
                texts[name[:-len(".jsonl")]] = text
    finally:
        os.close(events_fd)
    return texts, warnings


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode)
            or stat.S_ISBLK(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a file")
