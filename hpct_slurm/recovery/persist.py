"""Snapshots on disk: the last resort when no peer holds a good copy.

One file per snapshot, `<dir>/rank<R>/step<S>.bin`:

    "HPCTSNP4" | u32 big-endian meta length
    | meta JSON {"kind", "rank", "step", "digest", "layout"} | 32-byte MAC | flat data

written to a fresh temp file (never through a link), fsynced, then renamed, so a crash leaves
either the old file or the new one (and its temp file, which the rank dir's next save removes
once it is a minute old, and the close of the persister writing there at once: `sweep_stale`).
A large snapshot's data goes past the page cache (O_DIRECT, `_write_direct`), so its meta JSON is padded with spaces until the data starts on a
4 KiB boundary of the file; readers see the same format. `digest` is the snapshot's own (hex,
the BLAKE3 tree of protocol/digest.py) and covers the data, so saving hashes nothing new;
the MAC is HMAC-SHA256 over everything before it, keyed with the job's secret: a plain digest
anyone can compute would let whoever can write a file here hand the job a training state. Sizes are checked against the file before anything is allocated.
The last two are kept; `load_latest` falls back to the older if the newer fails its checks.

Where a file lies says what it must hold, and the MAC binds that too: `kind` is "shared" under
`persist/` (a shard key's shared state, `rank` being that key) and "rank" under `persist-rank/`
(a rank's own state: its sampler position), `rank` and `step` are those of the file's name. A
file whose MACed header disagrees with its place (a shared-state file copied into
`persist-rank/`, which an unbound header let load as a rank's own state; another rank's or
step's file renamed) is refused, naming what disagreed.

The magic is the format version. Older formats are refused by name (restore from a peer, or
with the release that wrote them), never half-checked: "HPCTSNP2" files carry a SHA-256 tree
digest, which this version no longer computes; "HPCTSNP3" files do not bind their kind.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import hmac
import json
import mmap
import os
import re
import stat
import struct
import time
from pathlib import Path

import numpy as np

from .. import protocol as P
from ..errors import HpctError, describe
from ..events import Ev, EventLog
from ..rundir import replacing
from .encoding import Layout
from .snapshot import SnapshotStore
from .worker import BackgroundQueue

KEEP = 2
MAGIC = b"HPCTSNP4"
# Data of this size or more is written past the page cache (_write_direct), in chunks of
# DIRECT_CHUNK through an aligned buffer, starting on an IO_BLOCK boundary of the file.
DIRECT_MIN = 1 << 20
DIRECT_CHUNK = 8 << 20
IO_BLOCK = 4096
# How much lower than the training threads a save's hash and write run (DiskPersister): the
# lowest a thread can be
WRITE_NICE = 19
# Older formats, named when refused: what they hold that this version cannot check.
_OLD_FORMATS = {b"HPCTSNP2": "a SHA-256 tree digest (hpct-slurm before BLAKE3 part digests)",
                b"HPCTSNP3": "no kind (shared or rank state) bound by its MAC (an older "
                             "hpct-slurm): it could be a file of the other kind moved here"}
# The kind of state a persist root holds, by the root's name (recovery/snapshot_policy.py
# writes the shared state under `persist/`, a rank's own under `persist-rank/`); any other
# root holds shared state.
SHARED, RANK = "shared", "rank"
_KIND_OF_ROOT = {"persist-rank": RANK}
_LEN = struct.Struct(">I")
_MAC_LEN = hashlib.sha256().digest_size
_HEADER = len(MAGIC) + _LEN.size
_NAME = re.compile(r"step([0-9]{1,18})\.bin")
_TMP = re.compile(r"\.step[0-9]{1,18}\.bin\.[0-9a-f]{12}\.tmp")  # rundir.replacing's names
# A save's temp file left this long without its writer's lock was left by a crash.
STALE_TMP_S = 60.0
# At a persister's close no later save will sweep: this young is enough there (a live writer
# locks its temp file microseconds after creating it; a loaded node may hold it off longer).
CLOSE_TMP_S = 1.0
# How long an interpreter's exit waits for a persister nobody closed to finish its saves.
EXIT_WAIT_S = 10.0

EV_SAVED = Ev.PERSIST_SAVED
EV_SAVE_FAILED = Ev.PERSIST_SAVE_FAILED
EV_CORRUPT = Ev.PERSIST_CORRUPT


def rank_dir(root: str | os.PathLike, rank: int) -> Path:
    return Path(root) / f"rank{rank}"


def kind_of(root: str | os.PathLike) -> str:
    """The kind of state the files under persist root `root` hold: SHARED or RANK."""
    return _KIND_OF_ROOT.get(Path(root).name, SHARED)


def _mac(key: bytes, head: bytes) -> bytes:
    # A key of its own, derived from the job secret: a snapshot MAC can never be replayed as,
    # or confused with, a protocol frame's.
    subkey = hmac.new(key, b"hpct persisted snapshot", hashlib.sha256).digest()
    return hmac.new(subkey, head, hashlib.sha256).digest()


def write_snapshot(root: str | os.PathLike, rank: int, step: int, layout: Layout,
                   data: memoryview, digest: bytes, *, key: bytes) -> Path:
    """Durably write one snapshot, MACed with `key` (the job secret), and prune all but the
    newest `KEEP`."""
    d = rank_dir(root, rank)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = d / f"step{step}.bin"
    meta = json.dumps({"kind": kind_of(root), "rank": rank, "step": step,
                       "digest": digest.hex(), "layout": json.loads(layout.to_json())},
                      separators=(",", ":")).encode()
    direct = len(data) >= DIRECT_MIN
    if direct:
        # the data starts on an I/O block: JSON ignores the trailing spaces, the MAC covers them
        meta += b" " * (-(_HEADER + len(meta) + _MAC_LEN) % IO_BLOCK)
    head = MAGIC + _LEN.pack(len(meta)) + meta
    with replacing(final, durable=True) as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # a save in progress: never swept (sweep_stale)
        f.write(head)
        f.write(_mac(key, head))
        if direct:
            f.flush()
            _write_direct(f.fileno(), data)
        else:
            f.write(data)
    for old in list_steps(root, rank)[:-KEEP]:
        (d / f"step{old}.bin").unlink(missing_ok=True)
    sweep_stale(d)
    return final


def sweep_stale(d: Path, older_than_s: float = STALE_TMP_S) -> list[str]:
    """Remove from the rank dir `d` the temp files of saves a crash cut short (issue 45.6:
    `.stepN.bin.<hex>.tmp`, which nothing removed): only names of that form (`replacing`'s),
    last written over `older_than_s` ago, that no writer holds locked (a live save holds its
    temp file under flock from just after its creation until its rename, and a dead writer's
    lock went with its process). The names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed  # the save itself is done: a sweep never fails it
    for name in names:
        if not _TMP.fullmatch(name):
            continue
        try:
            fd = os.open(d / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, or a link (never touched)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < older_than_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a save holds it
            os.unlink(d / name)
            removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _write_direct(fd: int, data: memoryview) -> None:
    """`data` at the file's (block-aligned) position past the page cache (O_DIRECT), from
    `data` itself where it is block-aligned, else through an aligned bounce buffer; its last
    partial block, and all of it where the file system refuses O_DIRECT, through the cache as
    before.

    Why: a buffered write of a whole training state fills the page cache and makes the kernel
    write it back while the step computes. `hpct-slurm bench replication` measured the
    persistence as it then was (100 MB every 10 steps of 40 ms) at +38 % of the step on 2 cores,
    and a compute loop beside a writer of 100 MB files slowed +18 % with buffered writes,
    +3.5-8.8 % with O_DIRECT (the same run)."""
    mv = memoryview(data).cast("B")
    bulk = len(mv) - len(mv) % IO_BLOCK
    done = 0
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        bulk = 0  # not on this file system (tmpfs before Linux 6.6, some overlays)
    if bulk:
        # O_DIRECT reads from block-aligned memory: `data` itself where it is (the persister's
        # own buffer), else a page-aligned bounce buffer it is copied through
        aligned = bool(len(mv)) and np.frombuffer(mv, np.uint8).ctypes.data % IO_BLOCK == 0
        bounce = None if aligned else mmap.mmap(-1, min(DIRECT_CHUNK, bulk))
        try:
            while done < bulk:
                n = min(DIRECT_CHUNK, bulk - done)
                if bounce is None:
                    chunk = mv[done:done + n]
                else:
                    bounce[:n] = mv[done:done + n]
                    chunk = memoryview(bounce)[:n]
                try:
                    wrote = os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or done:
                        raise
                    break  # the first direct write refused: the rest through the cache
                finally:
                    chunk.release()
                done += wrote
        finally:
            if bounce is not None:
                bounce.close()
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    while done < len(mv):
        done += os.write(fd, mv[done:])


def list_steps(root: str | os.PathLike, rank: int) -> list[int]:
    d = rank_dir(root, rank)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.fullmatch(p.name)))


def read_snapshot(path: Path, rank: int, *, key: bytes) -> tuple[int, Layout, bytearray, bytes]:
    """(step, layout, data, digest) of `rank`'s snapshot file `<root>/rank<R>/step<S>.bin`;
    raises HpctError if it is damaged, not written with `key`, or its MACed header names
    another kind, rank or step than its place. Nothing is allocated beyond what the file
    holds."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_HEADER)
            old = _OLD_FORMATS.get(head[:len(MAGIC)])
            if old is not None:
                raise HpctError(f"snapshot file '{path}' is format {head[:len(MAGIC)].decode()} "
                                f"with {old}; this version reads only {MAGIC.decode()} "
                                f"and cannot verify it")
            if len(head) < _HEADER or not head.startswith(MAGIC):
                raise HpctError(f"snapshot file '{path}' is not an hpct snapshot of this "
                                f"version (it does not start with {MAGIC!r})")
            (mlen,) = _LEN.unpack(head[len(MAGIC):])
            if _HEADER + mlen + _MAC_LEN > size:
                raise HpctError(f"snapshot file '{path}' is truncated: its header claims "
                                f"{mlen} bytes of metadata, the file has {size} bytes")
            meta_raw = f.read(mlen)
            mac = f.read(_MAC_LEN)
            if not hmac.compare_digest(_mac(key, head + meta_raw), mac):
                raise HpctError(f"snapshot file '{path}' was not written with this job's "
                                f"secret, or was changed since")
            meta = json.loads(meta_raw)
            layout = Layout.from_json(json.dumps(meta["layout"]))
            digest = bytes.fromhex(meta["digest"])
            step = int(meta["step"])
            _check_place(path, rank, meta)
            have = size - (_HEADER + mlen + _MAC_LEN)
            if layout.nbytes != have:
                raise HpctError(f"snapshot file '{path}' is damaged: its layout needs "
                                f"{layout.nbytes} data bytes, the file holds {have}")
            data = bytearray(layout.nbytes)
            got = f.readinto(data)
    # OverflowError: a JSON Infinity where an int belongs (the step)
    except (OSError, struct.error, ValueError, KeyError, TypeError, OverflowError) as exc:
        raise HpctError(f"snapshot file '{path}' is unreadable: {describe(exc)}") from None
    if got != layout.nbytes:
        raise HpctError(f"snapshot file '{path}' is truncated: {got} of {layout.nbytes} data bytes")
    if not hmac.compare_digest(P.part_digest(data), digest):
        raise HpctError(f"snapshot file '{path}' fails its digest")
    return step, layout, data, digest


def _check_place(path: Path, rank: int, meta: dict) -> None:
    """The kind, rank and step the MACed header binds must be those of the file's place."""
    kind = kind_of(path.parent.parent)
    named = _NAME.fullmatch(path.name)
    want = {"kind": kind, "rank": rank, "step": int(named.group(1)) if named else meta["step"]}
    for field, value in want.items():
        if meta[field] != value:
            raise HpctError(f"snapshot file '{path}' holds {_what(meta)} where {_what(want)} "
                            f"belongs: its {field} disagrees with its place (it was moved or "
                            f"copied here); not loaded")


def _what(meta: dict) -> str:
    whose = "shard key" if meta["kind"] == SHARED else "rank"
    return f"{meta['kind']} state of {whose} {meta['rank']} at step {meta['step']}"


def load_latest(root: str | os.PathLike, rank: int, max_step: int | None = None,
                events: EventLog | None = None, *, key: bytes) -> tuple[int, Layout, bytearray]:
    """The newest intact snapshot of `rank` (at or before `max_step`) written with `key`,
    older ones as fallback."""
    steps = [s for s in list_steps(root, rank) if max_step is None or s <= max_step]
    newest_error = ""
    for step in reversed(steps):
        path = rank_dir(root, rank) / f"step{step}.bin"
        try:
            got_step, layout, data, _ = read_snapshot(path, rank, key=key)
            if got_step != step:
                raise HpctError(f"snapshot file '{path}' holds step {got_step}")
            return got_step, layout, data
        except HpctError as exc:
            newest_error = newest_error or exc.message
            if events:
                events.emit(EV_CORRUPT, rank=rank, step=step, path=str(path), error=exc.message)
    raise HpctError(f"no intact snapshot of rank {rank} under '{rank_dir(root, rank)}'"
                    + (f" at or before step {max_step}" if max_step is not None else "")
                    + (f" (newest: {newest_error})" if newest_error else ""))


class DiskPersister:
    """Writes a committed snapshot to disk every `every` steps, from background threads.

    Saved: the first commit at or after each multiple of `every` (the same steps as
    `step % every == 0` when commits happen every step; with `SnapshotStore(every=K)` commits,
    as close to that as commits allow).

    One thread leases the snapshot only while copying it into a buffer of its own (memory
    speed: the slot's next writer may come two steps later), then hands the copy to a second
    thread, at the lowest CPU priority (WRITE_NICE), that hashes it where the snapshot is not
    sealed yet and writes it. Why the second: the hash and the write are most of a save's CPU
    (about 50 ms for 100 MB on this project's 2-core VM), and at the usual priority they took
    it from the training step's own threads: `hpct-slurm bench replication` measured a save at
    ~80 ms of step time. At the lowest priority they run where the step leaves a core idle
    (its collectives, its single-threaded moments), yet never starve: a nice-19 thread still
    gets a share of a busy core. A save still running when the next one is due makes the next
    one skip (event `persist.save_failed` is not emitted for that; the newest due snapshot
    wins).
    """

    def __init__(self, store: SnapshotStore, root: str | os.PathLike, rank: int, every: int,
                 events: EventLog | None = None, *, key: bytes):
        if every < 1:
            raise HpctError(f"persist interval every={every} must be >= 1 step")
        self.store, self.root, self.rank, self.every = store, Path(root), rank, every
        self.events = events
        self.key = key  # the job secret, which MACs every file written
        self.last_saved: int | None = None
        self._last_commit: int | None = None
        # the copy's buffer: page-aligned (mmap), so a large file is written from it past
        # the page cache without a bounce buffer (_write_direct)
        self._buf: mmap.mmap | None = None
        self._due: BackgroundQueue[int] = BackgroundQueue(f"hpct-persist-r{rank}", self._save,
                                                          maxsize=1)
        self._write: BackgroundQueue[tuple] = BackgroundQueue(
            f"hpct-persist-write-r{rank}", self._write_out, lazy=True, nice=WRITE_NICE)
        # A script that ends without the Job's shutdown (its own exception, sys.exit): the
        # interpreter's exit would stop the writer thread mid-save and leave its temp file.
        atexit.register(self._end, EXIT_WAIT_S)

    def after_commit(self, step: int) -> bool:
        """Call after each `store.commit(step)`; returns whether a save was queued."""
        prev, self._last_commit = self._last_commit, step
        if prev is None or prev >= step:
            prev = step - 1
        if step // self.every == prev // self.every:  # no multiple of `every` in (prev, step]
            return False
        return self._due.put(step, wait=False)

    def _save(self, step: int) -> None:
        try:
            with self.store.lease(step) as snap:
                if snap is None:
                    return  # already superseded twice; the next due step will be saved
                n = snap.layout.nbytes
                if self._buf is None or len(self._buf) < n:
                    # (the old map is unmapped once the last view of it is gone)
                    self._buf = mmap.mmap(-1, max(n, 1))
                data = memoryview(self._buf)[:n]
                data[:] = snap.data
                digest = snap.digest() if snap.sealed else None
        except (OSError, HpctError) as exc:
            if self.events:
                self.events.emit(EV_SAVE_FAILED, rank=self.rank, step=step, error=describe(exc))
            return
        # the buffer is the writer's until it is done: this thread waits for it
        self._write.put((step, snap, data, digest))
        self._write.flush()

    def _write_out(self, item: tuple) -> None:
        step, snap, data, digest = item
        try:
            if digest is None:
                # hashed from the copy (the same bytes, taken under the lease), and the
                # snapshot sealed with it as a save always did: its first server hashes nothing
                leaves = P.leaf_digests(data, parallel=False) or []
                digest = P.range_digest(leaves, len(data), 0, len(data))
                if not snap.superseded.is_set() and not snap.sealed:
                    snap.seal_with(leaves)
            path = write_snapshot(self.root, self.rank, step, snap.layout, data, digest,
                                  key=self.key)
            self.last_saved = step
            if self.events:
                self.events.emit(EV_SAVED, rank=self.rank, step=step, path=str(path),
                                 nbytes=len(data))
        except (OSError, HpctError) as exc:
            if self.events:
                self.events.emit(EV_SAVE_FAILED, rank=self.rank, step=step, error=describe(exc))

    def flush(self) -> None:
        """Wait until queued saves are on disk."""
        self._due.flush()

    def close(self) -> None:
        self._end(None)

    def _end(self, timeout: float | None) -> None:
        """Finish the saves queued (waiting at most `timeout` for each thread), then remove
        what a killed writer of this rank dir left (a crashed node's rank before this one took
        its key): no later save of this job may come to do it."""
        atexit.unregister(self._end)
        if self._due.close(timeout) and self._write.close(timeout):
            sweep_stale(rank_dir(self.root, self.rank), older_than_s=CLOSE_TMP_S)
