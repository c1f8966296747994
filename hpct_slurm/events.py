"""Structured events: one JSON object a line, with a stable set of names.

The controller, the ranks, the report and the tests all read the same record, so event
names are constants here and nowhere else.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterator

from .errors import HpctError


class EventLog:
    """Append-only JSON-lines writer; safe to share between threads."""

    def __init__(self, path: str | os.PathLike | None = None, stream: IO[str] | None = None,
                 source: str = ""):
        self._path = Path(path) if path else None
        self._stream = stream
        self._source = source
        self._lock = threading.Lock()
        if self._path:
            self._path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict:
        record = {"t": time.time(), "event": event}
        if self._source:
            record["source"] = self._source
        record.update(fields)
        line = json.dumps(record, sort_keys=False, default=str)
        with self._lock:
            if self._path:
                _append(self._path, (line + "\n").encode())
            if self._stream:
                self._stream.write(line + "\n")
                self._stream.flush()
        return record


# Never through a symlink, never into a fifo or a device: the hooks log as root and the
# controller as the job's user, and a link planted where a log goes would make them append to
# whatever file it points at (O_NONBLOCK: a planted fifo fails at once instead of hanging).
_APPEND_FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC)


def _append(path: Path, data: bytes) -> None:
    try:
        fd = os.open(path, _APPEND_FLAGS, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise HpctError(f"event log {path} is a symlink; logs are never written through "
                            f"a link: remove it") from None
        raise HpctError(f"event log {path} cannot be opened ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HpctError(f"event log {path} is not a regular file: remove it")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def read_events(path: str | os.PathLike) -> Iterator[dict]:
    """Yield events from a JSON-lines file, skipping a torn last line."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def stderr_log(source: str = "") -> EventLog:
    return EventLog(stream=sys.stderr, source=source)
