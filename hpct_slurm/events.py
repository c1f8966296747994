"""Structured events: one JSON object a line, with a stable set of names.

The controller, the ranks, the report and the tests all read the same record, so event
names are constants here and nowhere else.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterator


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
                with open(self._path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            if self._stream:
                self._stream.write(line + "\n")
                self._stream.flush()
        return record


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
