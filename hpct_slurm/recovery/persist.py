"""Snapshots on disk: the last resort when no peer holds a good copy.

One file per snapshot, `<dir>/rank<R>/step<S>.bin`:

    u32 big-endian meta length | meta JSON {"step", "digest", "layout"} | flat data

written to a temp file, fsynced, then renamed, so a crash leaves either the old file or the new
one. `digest` is the snapshot's own (hex), so saving hashes nothing new. The last two are kept;
`load_latest` falls back to the older if the newer fails its digest.
"""
from __future__ import annotations

import hmac
import json
import os
import queue
import re
import struct
import threading
from pathlib import Path

import torch

from .. import protocol as P
from ..errors import HpctError
from ..events import EventLog
from .snapshot import SnapshotStore
from .state import Layout, as_memoryview

KEEP = 2
_LEN = struct.Struct(">I")
_NAME = re.compile(r"^step(\d+)\.bin$")

EV_SAVED = "persist.saved"
EV_SAVE_FAILED = "persist.save_failed"
EV_CORRUPT = "persist.corrupt"


def rank_dir(root: str | os.PathLike, rank: int) -> Path:
    return Path(root) / f"rank{rank}"


def write_snapshot(root: str | os.PathLike, rank: int, step: int, layout: Layout,
                   data: memoryview, digest: bytes) -> Path:
    """Durably write one snapshot and prune all but the newest `KEEP`."""
    d = rank_dir(root, rank)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step{step}.bin"
    tmp = d / f".step{step}.bin.tmp{os.getpid()}"
    meta = json.dumps({"step": step, "digest": digest.hex(), "layout": json.loads(layout.to_json())},
                      separators=(",", ":")).encode()
    with open(tmp, "wb") as f:
        f.write(_LEN.pack(len(meta)))
        f.write(meta)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)  # make the rename itself durable
    finally:
        os.close(dfd)
    for old in list_steps(root, rank)[:-KEEP]:
        (d / f"step{old}.bin").unlink(missing_ok=True)
    return final


def list_steps(root: str | os.PathLike, rank: int) -> list[int]:
    d = rank_dir(root, rank)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name)))


def read_snapshot(path: Path) -> tuple[int, Layout, bytearray, bytes]:
    """(step, layout, data, digest) of one file; raises HpctError if damaged."""
    try:
        with open(path, "rb") as f:
            (mlen,) = _LEN.unpack(f.read(_LEN.size))
            meta = json.loads(f.read(mlen))
            layout = Layout.from_json(json.dumps(meta["layout"]))
            digest = bytes.fromhex(meta["digest"])
            data = bytearray(layout.nbytes)
            got = f.readinto(data)
    except (OSError, struct.error, ValueError, KeyError, TypeError) as exc:
        raise HpctError(f"snapshot file '{path}' is unreadable: {exc}") from None
    if got != layout.nbytes:
        raise HpctError(f"snapshot file '{path}' is truncated: {got} of {layout.nbytes} data bytes")
    if not hmac.compare_digest(P.part_digest(data), digest):
        raise HpctError(f"snapshot file '{path}' fails its digest")
    return int(meta["step"]), layout, data, digest


def load_latest(root: str | os.PathLike, rank: int, max_step: int | None = None,
                events: EventLog | None = None) -> tuple[int, Layout, bytearray]:
    """The newest intact snapshot of `rank` (at or before `max_step`), older ones as fallback."""
    steps = [s for s in list_steps(root, rank) if max_step is None or s <= max_step]
    for step in reversed(steps):
        path = rank_dir(root, rank) / f"step{step}.bin"
        try:
            got_step, layout, data, _ = read_snapshot(path)
            return got_step, layout, data
        except HpctError as exc:
            if events:
                events.emit(EV_CORRUPT, rank=rank, step=step, path=str(path), error=exc.message)
    raise HpctError(f"no intact snapshot of rank {rank} under '{rank_dir(root, rank)}'"
                    + (f" at or before step {max_step}" if max_step is not None else ""))


class DiskPersister:
    """Writes a committed snapshot to disk every `every` steps, from a background thread.

    Saved: the first commit at or after each multiple of `every` (the same steps as
    `step % every == 0` when commits happen every step; with `SnapshotStore(every=K)` commits,
    as close to that as commits allow).

    The thread leases the snapshot only while copying it into its own buffer (memory speed), then
    writes without holding anything, so training is not held up by the disk. A save still running
    when the next one is due makes the next one skip (event `persist.save_failed` is not emitted
    for that; the newest due snapshot wins).
    """

    def __init__(self, store: SnapshotStore, root: str | os.PathLike, rank: int, every: int,
                 events: EventLog | None = None):
        if every < 1:
            raise HpctError(f"persist interval every={every} must be >= 1 step")
        self.store, self.root, self.rank, self.every = store, Path(root), rank, every
        self.events = events
        self.last_saved: int | None = None
        self._last_commit: int | None = None
        self._buf: torch.Tensor | None = None
        self._due: queue.Queue[int | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._loop, name=f"hpct-persist-r{rank}", daemon=True)
        self._thread.start()

    def after_commit(self, step: int) -> bool:
        """Call after each `store.commit(step)`; returns whether a save was queued."""
        prev, self._last_commit = self._last_commit, step
        if prev is None or prev >= step:
            prev = step - 1
        if step // self.every == prev // self.every:  # no multiple of `every` in (prev, step]
            return False
        try:
            self._due.put_nowait(step)
        except queue.Full:
            return False
        return True

    def _loop(self) -> None:
        while (step := self._due.get()) is not None:
            try:
                with self.store.lease(step) as snap:
                    if snap is None:
                        continue  # already superseded twice; the next due step will be saved
                    n = snap.layout.nbytes
                    if self._buf is None or self._buf.numel() < n:
                        self._buf = torch.empty(n, dtype=torch.uint8)
                    data = as_memoryview(self._buf)[:n]
                    data[:] = snap.data
                    layout, digest = snap.layout, snap.digest()
                path = write_snapshot(self.root, self.rank, step, layout, data, digest)
                self.last_saved = step
                if self.events:
                    self.events.emit(EV_SAVED, rank=self.rank, step=step, path=str(path), nbytes=n)
            except (OSError, HpctError) as exc:
                if self.events:
                    self.events.emit(EV_SAVE_FAILED, rank=self.rank, step=step, error=str(exc))
            finally:
                self._due.task_done()

    def flush(self) -> None:
        """Wait until queued saves are on disk."""
        self._due.join()

    def close(self) -> None:
        self.flush()
        self._due.put(None)
        self._thread.join()
