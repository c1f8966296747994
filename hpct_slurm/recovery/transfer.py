"""Peer-to-peer state transfer over TCP, authenticated with the job's protocol secret.

Every rank runs a `TransferServer` that serves its own latest snapshots and the replicas it holds
(`FetchState` -> `StateBlob` whose body is the layout JSON then the flat data, sent straight from
the snapshot memory) and accepts replicas pushed by its ring neighbour (`StateBlob` -> `Ack`).
A replacement calls `fetch_state` with the holders the controller named; each source is tried in
order, the data is received into a preallocated buffer while its digest is computed on the hash
threads, and the first copy matching the digest in the (MAC-authenticated) frame header wins;
disk is the last resort.

The sender never hashes the data: the frame carries the snapshot's own digest, sealed once after
commit (see snapshot.py). The receiver hashes every byte, so a copy that rotted in the holder's
memory is caught there; `verify_on_serve` additionally re-hashes on the holder while sending (it
then stops offering a rotten copy) at the price of hashing every byte twice per transfer.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import protocol as P
from ..accept_pause import AcceptPause
from ..errors import HpctError
from ..events import Ev, EventLog
from .copies import as_flat_u8, as_memoryview
from .encoding import Layout
from .peer_socket import Address
from .peer_socket import connect as _connect  # (bench/transfer.py imports both from here)
from .peer_socket import peer_of
from .peer_socket import tune as _tune
from .persist import load_latest
from .replicas import ReplicaStore
from .slots import Snapshot
from .snapshot import SnapshotStore
from .striped import serve_part
from .worker import BackgroundQueue

EV_FETCHED = Ev.TRANSFER_FETCHED
EV_SOURCE_FAILED = Ev.TRANSFER_SOURCE_FAILED
EV_FALLBACK_DISK = Ev.TRANSFER_FALLBACK_DISK
EV_SERVE_CORRUPT = Ev.TRANSFER_SERVE_CORRUPT
EV_BAD_FRAME = Ev.TRANSFER_BAD_FRAME
EV_CONN_LOST = Ev.TRANSFER_CONNECTION_LOST
EV_REPLICA_STORED = Ev.REPLICA_STORED
EV_REPLICA_REJECTED = Ev.REPLICA_REJECTED
EV_PUSH_FAILED = Ev.REPLICA_PUSH_FAILED
EV_CONN_EVICTED = Ev.TRANSFER_CONNECTION_EVICTED
EV_CONN_REFUSED = Ev.TRANSFER_CONNECTION_REFUSED
EV_ACCEPT_FAILED = Ev.TRANSFER_ACCEPT_FAILED

# "The newest step held". Not -1: that is a real step, the state at creation (before step 0),
# which a fault during the first step restores.
LATEST = -(2**62)
LAYOUT_MAX = 64 * 1024 * 1024
# A new connection is a stranger until its first frame authenticates: its header must arrive
# within AUTH_TIMEOUT, and at MAX_CONNECTIONS the oldest stranger makes room for a newcomer.
# Legitimate peers are few (the ring neighbour's pusher, a replacement or two fetching) and
# send their first header at once.
AUTH_TIMEOUT = 5.0
MAX_CONNECTIONS = 64
# Longest pause between accept retries while the process is out of descriptors or memory.
ACCEPT_BACKOFF_MAX = 1.0
# A refused push (stale, or too big to allocate) up to this size is read and thrown away, so
# the connection stays usable; a bigger one is cut off.
REFUSED_DRAIN_MAX = 64 * 1024 * 1024


def physical_memory() -> int:
    """Bytes of RAM on this host: no snapshot or replica can be larger, whatever a header says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40


def _send_blob(sock: socket.socket, chan: P.Channel, rank: int, snap: Snapshot,
               timeout: float | None, verify: bool) -> bool:
    """Stream `snap` under its sealed digest. With `verify`, re-hash the memory on the hash
    threads while it goes out and hold back the last piece until that is done: on a mismatch
    close the socket (the receiver sees a truncated frame) and return False."""
    layout_json = snap.layout.to_json()
    msg = P.StateBlob(rank, snap.step, snap.layout.nbytes, len(layout_json))
    digest = snap.digest()
    if not verify and len(layout_json) + len(snap.data) <= P.CHUNK:
        # A small snapshot (a rank's own state, pushed every step): the whole frame in one
        # send, one segment for the receiver to wake up for instead of one per part.
        chan.send(sock, msg, [layout_json, snap.data], timeout, [None, digest])
        return True
    check = None
    if verify:
        check = P.PartHasher(len(snap.data))
        for off in range(0, len(snap.data), P.CHUNK):
            check.add(snap.data[off:off + P.CHUNK])
    writer = chan.writer(sock, msg, [len(layout_json), snap.layout.nbytes],
                         [P.part_digest(layout_json), digest], timeout)  # type: ignore[list-item]
    writer.write(layout_json)
    tail = min(len(snap.data), P.CHUNK)
    writer.write(snap.data[:len(snap.data) - tail])
    if check is not None and check.digest() != digest:
        sock.close()
        return False
    writer.write(snap.data[len(snap.data) - tail:])
    writer.finish()
    return True


class TransferServer:
    """Serves this rank's snapshots and stores pushed replicas (one thread per connection, at
    most `max_connections`).

    `io_timeout`: a peer that stalls mid-frame, or sends nothing for this long, is dropped.
    `max_replica_bytes` (default: the host's RAM) bounds a pushed replica before anything is
    allocated for it.
    """

    def __init__(self, secret: bytes, job_id: str, rank: int, own: SnapshotStore | None = None,
                 replicas: ReplicaStore | None = None, host: str = "127.0.0.1", port: int = 0,
                 rank_own: SnapshotStore | None = None,
                 events: EventLog | None = None, verify_on_serve: bool = False,
                 max_replica_bytes: int | None = None, io_timeout: float = 60.0,
                 auth_timeout: float = AUTH_TIMEOUT, max_connections: int = MAX_CONNECTIONS):
        self.secret, self.job_id, self.rank = secret, job_id, rank
        self.own, self.replicas, self.rank_own = own, replicas, rank_own
        self.events = events
        self.verify_on_serve = verify_on_serve
        # Fault injection for tests (HPCT_FAULT_CORRUPT_SERVE): rot one byte of each snapshot
        # this server serves, once, after its digest was sealed, as failing memory would.
        self.corrupt_on_serve = False
        self._rotted: set[tuple[int, int]] = set()
        self.max_replica_bytes = physical_memory() if max_replica_bytes is None \
            else max_replica_bytes
        self.io_timeout = io_timeout
        self.auth_timeout = auth_timeout
        self.max_connections = max_connections
        self._listener = socket.create_server((host, port), backlog=64)
        self.address: Address = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._freed = threading.Event()  # a connection ended: a paused accept may go on
        # Open connections, oldest first -> whether one of its frames has authenticated.
        self._conns: dict[socket.socket, bool] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name=f"hpct-transfer-r{rank}",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._freed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        self._thread.join()

    def __enter__(self) -> "TransferServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _emit(self, event: str, **fields: Any) -> None:
        if self.events:
            self.events.emit(event, server_rank=self.rank, **fields)

    def _accept_loop(self) -> None:
        # Out of descriptors or memory: pause and accept again (accept_pause.py), or this rank
        # would serve its state and take replicas no more for the rest of its life.
        pause = AcceptPause(lambda **f: self._emit(EV_ACCEPT_FAILED, **f), self.events,
                            max_s=ACCEPT_BACKOFF_MAX)
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                self._freed.wait(pause.failed(exc))
                self._freed.clear()
                continue
            pause.accepted()
            self._admit(conn, f"{peer[0]}:{peer[1]}")

    def _admit(self, conn: socket.socket, peer: str) -> None:
        """Give `conn` a thread, making room at the cap by dropping the oldest connection that
        has not authenticated: strangers holding connections open cannot lock out the job."""
        with self._lock:
            if len(self._conns) >= self.max_connections:
                stranger = next((c for c, known in self._conns.items() if not known), None)
                if stranger is None:
                    conn.close()
                    self._emit(EV_CONN_REFUSED, peer=peer,
                               error=f"{self.max_connections} authenticated connections open")
                    return
                del self._conns[stranger]
                with contextlib.suppress(OSError):
                    stranger.shutdown(socket.SHUT_RDWR)  # its thread sees EOF and ends
                self._emit(EV_CONN_EVICTED, peer=peer,
                           error=f"at the cap of {self.max_connections} connections: dropped the "
                                 f"oldest one that had not authenticated")
            self._conns[conn] = False
        try:
            _tune(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"hpct-transfer-r{self.rank}-conn").start()
        except (OSError, RuntimeError) as exc:  # RuntimeError: no thread could be started
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
            self._emit(EV_CONN_REFUSED, peer=peer, error=str(exc))

    def _serve(self, conn: socket.socket) -> None:
        known, peer = False, peer_of(conn)
        try:
            # The stall limit for everything on this connection; the nonce binds its frames.
            chan = P.server_hello(conn, self.secret, self.job_id, self.io_timeout)
            while not self._closed.is_set():
                pending: dict[str, Any] = {}
                try:
                    env = chan.recv(conn, max_body=self.max_replica_bytes + LAYOUT_MAX,
                                    body_sink=self._replica_sink(pending),
                                    header_timeout=None if known else self.auth_timeout)
                except P.ConnectionClosed:
                    return
                except P.DigestMismatch as exc:
                    # The frame was read whole, so the connection is still usable: say why.
                    self._reject_replica(conn, chan, exc.msg, pending, exc.message)
                    continue
                except HpctError as exc:
                    self._refuse(conn, chan, pending, exc.message,
                                 cut=(peer, known) if isinstance(exc, P.ConnectionCut) else None)
                    return
                if not known:
                    known = True
                    with self._lock:
                        if conn in self._conns:
                            self._conns[conn] = True
                msg = env.msg
                if isinstance(msg, P.FetchState):
                    if not self._serve_fetch(conn, chan, msg):
                        return
                elif isinstance(msg, P.StateBlob) and "refused" in pending:
                    self._emit(EV_REPLICA_REJECTED, rank=msg.rank, step=msg.step,
                               error=pending["refused"])
                    chan.send(conn, P.Ack(False, pending["refused"]), timeout=self.io_timeout)
                elif isinstance(msg, P.StateBlob):
                    self._store_replica(conn, chan, msg, env.digests[1], pending)
                elif isinstance(msg, P.Goodbye):
                    return
                else:
                    chan.send(conn, P.Ack(False, f"transfer server does not handle {msg.TYPE}"),
                              timeout=self.io_timeout)
        except P.ProtocolError:
            return
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
            self._freed.set()

    def _refuse(self, conn: socket.socket, chan: P.Channel, pending: dict[str, Any],
                why: str, cut: tuple[str, bool] | None = None) -> None:
        """A frame that failed part-way (before the connection is dropped): an authentic push
        is told why, anything else is only logged. `cut` (peer, authenticated): the connection
        broke under the frame, its peer's process or node died (a crash cuts its pusher's
        connection), which is no bad frame from a stranger."""
        if "idx" in pending:
            self.replicas.abandon(pending["rank"], pending["idx"])  # type: ignore[union-attr]
        msg = pending.get("msg")
        if msg is None and cut is not None:
            self._emit(EV_CONN_LOST, peer=cut[0], authenticated=cut[1], error=why)
            return
        if msg is None:
            self._emit(EV_BAD_FRAME, error=why)
            return
        self._emit(EV_REPLICA_REJECTED, rank=msg.rank, step=msg.step, error=why)
        with contextlib.suppress(HpctError, OSError):
            chan.send(conn, P.Ack(False, why), timeout=self.io_timeout)

    # --- fetch -------------------------------------------------------------------------------

    def _find(self, msg: P.FetchState) -> tuple[Callable[[], Any], str] | None:
        step = None if msg.step == LATEST else msg.step
        if msg.rank == self.rank and self.own is not None and msg.slot in ("own", "any"):
            return (lambda: self.own.lease(step)), "own"  # type: ignore[union-attr]
        if msg.rank == self.rank and self.rank_own is not None and msg.slot == "rank":
            return (lambda: self.rank_own.lease(step)), "rank"  # type: ignore[union-attr]
        if self.replicas is not None and msg.slot in ("replica", "any"):
            return (lambda: self.replicas.lease(msg.rank, step)), "replica"  # type: ignore[union-attr]
        return None

    def _serve_fetch(self, conn: socket.socket, chan: P.Channel, msg: P.FetchState) -> bool:
        found = self._find(msg)
        with (found[0]() if found else contextlib.nullcontext()) as snap:
            if snap is None:
                have = self.replicas.ranks() if self.replicas else []
                chan.send(conn, P.Ack(False, f"rank {self.rank} has no snapshot of rank {msg.rank} "
                                             f"at step {msg.step} (replicas held: {have})"),
                          timeout=self.io_timeout)
                return True
            # the middle of what is asked for: a striped pull's stripe rots too
            spot = (min(msg.offset + msg.length // 2, len(snap.data) - 1)
                    if msg.part == "range" else len(snap.data) // 2)
            if self.corrupt_on_serve and len(snap.data) and (id(snap), spot) not in self._rotted:
                self._rotted.add((id(snap), spot))
                snap.digest()
                snap.data[spot] ^= 0xFF
                self._emit(Ev.TRANSFER_FAULT_INJECTED, rank=msg.rank, step=snap.step)
            if msg.part != "all":  # a striped pull's manifest or stripe (striped.py)
                serve_part(conn, chan, msg.rank, snap, msg, self.io_timeout)
                return True
            if _send_blob(conn, chan, msg.rank, snap, self.io_timeout, self.verify_on_serve):
                return True
        # The memory no longer matches its digest: never offer this copy again.
        if found and found[1] == "replica" and self.replicas is not None:
            self.replicas.discard(msg.rank, snap)
        self._emit(EV_SERVE_CORRUPT, rank=msg.rank, step=snap.step, slot=found[1] if found else "")
        return False

    # --- replicas pushed to us -----------------------------------------------------------------

    def _reject_replica(self, conn: socket.socket, chan: P.Channel, msg: Any,
                        pending: dict[str, Any], why: str) -> None:
        rank = getattr(msg, "rank", -1)
        if "idx" in pending:
            self.replicas.abandon(pending["rank"], pending["idx"])  # type: ignore[union-attr]
            why = f"replica of rank {rank} at step {msg.step}: {why}; kept the previous replica"
        self._emit(EV_REPLICA_REJECTED, rank=rank, error=why)
        chan.send(conn, P.Ack(False, why), timeout=self.io_timeout)

    def _replica_sink(self, pending: dict[str, Any]) -> P.BodySink:
        def sink(msg: Any, sizes: Any) -> list[memoryview]:
            if not isinstance(msg, P.StateBlob):
                if sum(sizes) > P.DEFAULT_MAX_BODY:
                    raise P.ProtocolError(f"{msg.TYPE} with a {sum(sizes)}-byte body")
                return [memoryview(bytearray(n)) for n in sizes]
            pending["msg"] = msg  # authentic: if it is refused from here on, the pusher is told
            try:
                if self.replicas is None:
                    raise P.ProtocolError(f"rank {self.rank} holds no replicas")
                _check_blob_parts(msg, sizes)
                idx, buf = self.replicas.begin(msg.rank, msg.nbytes, msg.step)
            except HpctError as exc:
                if sum(sizes) > REFUSED_DRAIN_MAX:
                    raise
                # Read a small refused body into scratch, so the connection stays in step and
                # the pusher gets the reason in an Ack rather than a broken pipe.
                pending["refused"] = exc.message
                return [memoryview(bytearray(n)) for n in sizes]
            pending.update(rank=msg.rank, idx=idx, buf=buf, layout=bytearray(msg.layout_nbytes))
            return [memoryview(pending["layout"]), as_memoryview(buf)[:msg.nbytes]]
        return sink

    def _store_replica(self, conn: socket.socket, chan: P.Channel, msg: P.StateBlob,
                       digest: bytes, pending: dict[str, Any]) -> None:
        assert self.replicas is not None
        try:
            try:
                layout = Layout.from_json(bytes(pending["layout"]))
                if layout.nbytes != msg.nbytes:
                    raise HpctError(f"replica layout says {layout.nbytes} bytes, the frame {msg.nbytes}")
            except HpctError:
                self.replicas.abandon(msg.rank, pending["idx"])
                raise
            self.replicas.finish(msg.rank, pending["idx"], pending["buf"], msg.step, layout,
                                 digest, checked=True)
        except HpctError as exc:
            self._emit(EV_REPLICA_REJECTED, rank=msg.rank, step=msg.step, error=exc.message)
            chan.send(conn, P.Ack(False, exc.message), timeout=self.io_timeout)
            return
        self._emit(EV_REPLICA_STORED, rank=msg.rank, step=msg.step, nbytes=msg.nbytes)
        chan.send(conn, P.Ack(True, ""), timeout=self.io_timeout)



# --- fetching (the replacement's side) -------------------------------------------------------------

@dataclass(frozen=True)
class FetchResult:
    step: int
    layout: Layout
    data: Any          # the buffer holding layout.nbytes bytes: `into` when it was big enough
    source: str        # "host:port" or "disk:<dir>"


def _check_blob_parts(msg: P.StateBlob, sizes: Any) -> None:
    if msg.layout_nbytes > LAYOUT_MAX or list(sizes) != [msg.layout_nbytes, msg.nbytes]:
        raise P.ProtocolError(f"state_blob parts {list(sizes)} are not "
                              f"[{msg.layout_nbytes} layout, {msg.nbytes} data] bytes")


def _fetch_one(addr: Address, rank: int, secret: bytes, job_id: str, step: int,
               into: Any, timeout: float, slot: str = "any") -> FetchResult:
    holder: dict[str, Any] = {}

    def sink(msg: Any, sizes: Any) -> list[memoryview]:
        if not isinstance(msg, P.StateBlob):
            return [memoryview(bytearray(n)) for n in sizes]
        _check_blob_parts(msg, sizes)
        buf = into
        if buf is None or as_flat_u8(buf).numel() < msg.nbytes:
            try:
                buf = torch.empty(msg.nbytes, dtype=torch.uint8)
            except (RuntimeError, MemoryError) as exc:
                raise P.ProtocolError(f"cannot allocate {msg.nbytes} bytes for the state: "
                                      f"{exc}") from None
        holder.update(buf=buf, layout=bytearray(msg.layout_nbytes))
        return [memoryview(holder["layout"]), as_memoryview(as_flat_u8(buf))[:msg.nbytes]]

    with _connect(addr, timeout) as sock:
        chan = P.client_hello(sock, secret, job_id, timeout)
        chan.send(sock, P.FetchState(rank, step, slot), timeout=timeout)  # type: ignore[arg-type]
        try:
            env = chan.recv(sock, timeout=timeout, max_body=physical_memory() + LAYOUT_MAX,
                            body_sink=sink)
        except P.DigestMismatch as exc:
            raise HpctError(f"digest mismatch: {exc.message}") from None
        with contextlib.suppress(P.ProtocolError):
            chan.send(sock, P.Goodbye("done"), timeout=timeout)
    msg = env.msg
    if isinstance(msg, P.Ack):
        raise HpctError(f"source refused: {msg.detail}")
    if not isinstance(msg, P.StateBlob):
        raise HpctError(f"source answered {msg.TYPE} instead of state_blob")
    if msg.rank != rank or (step != LATEST and msg.step != step):
        raise HpctError(f"source sent rank {msg.rank} step {msg.step}, asked for rank {rank} step {step}")
    layout = Layout.from_json(bytes(holder["layout"]))
    if layout.nbytes != msg.nbytes:
        raise HpctError(f"layout says {layout.nbytes} bytes, the frame {msg.nbytes}")
    return FetchResult(msg.step, layout, holder["buf"], f"{addr[0]}:{addr[1]}")


def fetch_state(sources: list[Address], rank: int, secret: bytes, job_id: str,
                step: int = LATEST, into: Any = None, timeout: float = 60.0,
                disk_dir: str | None = None, events: EventLog | None = None,
                slot: str = "any") -> FetchResult:
    """`rank`'s snapshot at exactly `step` (LATEST: newest) from the first source with a good copy.

    `into` (a flat uint8 tensor, bytearray or numpy array) receives the data when it is big
    enough. Each failing source emits `transfer.source_failed` with the reason; when all fail and
    `disk_dir` is given, the newest intact disk snapshot at or before `step` is loaded and
    `transfer.fallback_disk` emitted — its step may be older, so the caller must check
    `result.step`. With nothing left, raises HpctError naming every failure. `slot`: which of
    a source's copies is asked for (FetchState.slot).
    """
    failures = []
    for addr in sources:
        addr = (str(addr[0]), int(addr[1]))
        try:
            result = _fetch_one(addr, rank, secret, job_id, step, into, timeout, slot)
        except (HpctError, OSError) as exc:
            reason = exc.message if isinstance(exc, HpctError) else f"{type(exc).__name__}: {exc}"
            failures.append(f"{addr[0]}:{addr[1]} ({reason})")
            if events:
                events.emit(EV_SOURCE_FAILED, rank=rank, step=step, source=f"{addr[0]}:{addr[1]}",
                            error=reason)
            continue
        if events:
            events.emit(EV_FETCHED, rank=rank, step=result.step, source=result.source,
                        nbytes=result.layout.nbytes)
        return result
    if disk_dir is not None:
        try:
            got_step, layout, data = load_latest(disk_dir, rank, None if step == LATEST else step,
                                                 events, key=secret)
        except HpctError as exc:
            failures.append(f"disk {disk_dir} ({exc.message})")
        else:
            if events:
                events.emit(EV_FALLBACK_DISK, rank=rank, step=step, disk_step=got_step,
                            dir=str(disk_dir), failed_sources=len(sources))
            return FetchResult(got_step, layout, data, f"disk:{disk_dir}")
    raise HpctError(f"no good copy of rank {rank}'s state at step {step}: tried "
                    + ("; ".join(failures) if failures else "no sources and no disk dir"))


# --- pushing replicas (replicated mode) -------------------------------------------------------------

def push_replica(sock: socket.socket, chan: P.Channel, rank: int, snap: Snapshot,
                 timeout: float = 60.0) -> None:
    """Send `snap` as `rank`'s replica over an open connection and wait for the holder's Ack."""
    _send_blob(sock, chan, rank, snap, timeout, verify=False)
    env = chan.recv(sock, timeout=timeout)
    if not isinstance(env.msg, P.Ack) or not env.msg.ok:
        detail = env.msg.detail if isinstance(env.msg, P.Ack) else env.msg.TYPE
        raise HpctError(f"replica holder refused rank {rank} step {snap.step}: {detail}")


class ReplicaPusher:
    """After each commit, sends this rank's snapshot to its replica holder in the background.

    One persistent connection (reconnected after an error). The pusher leases the snapshot while
    sending, so if a push is slower than two steps the commit after next waits for it: the replica
    is never more than one step behind. `acked_step` is the newest step the holder confirmed.

    Two ways to wait: `after_commit` then `flush` waits for this step's acknowledgement (the
    holder has the step when it returns); `push_next` waits only for the previous push's and
    lets this one go on in the background (the holder has the previous step when it returns,
    this one on its way: one round trip off the caller's path).
    """

    def __init__(self, store: SnapshotStore, rank: int, peer: Address, secret: bytes, job_id: str,
                 events: EventLog | None = None, timeout: float = 60.0):
        self.store, self.rank, self.peer = store, rank, (str(peer[0]), int(peer[1]))
        self.secret, self.job_id, self.events, self.timeout = secret, job_id, events, timeout
        self.acked_step: int | None = None
        self._sock: socket.socket | None = None
        self._chan: P.Channel | None = None
        self._aborted = False
        self._sock_lock = threading.Lock()  # abort against a connection being made
        self._due: BackgroundQueue[int] = BackgroundQueue(f"hpct-push-r{rank}", self._push_step,
                                                          maxsize=1)

    def after_commit(self, step: int) -> None:
        """Queue `step` for pushing; waits while the previous push is still queued."""
        self._due.put(step)

    def push_next(self, step: int) -> None:
        """Wait until the previous push is acknowledged (or failed: an event), then queue
        `step` without waiting for it. When this returns the holder has every step pushed
        before `step` (the newest of them, unless its push failed), and `step` is on its way
        while the caller goes on."""
        self._due.flush()
        self._due.put(step)

    def _failed(self, step: int, exc: BaseException) -> None:
        self._drop()
        if self.events and not self._aborted:
            self.events.emit(EV_PUSH_FAILED, rank=self.rank, step=step,
                             peer=f"{self.peer[0]}:{self.peer[1]}", error=str(exc))

    def _push_step(self, step: int) -> None:
        if self._aborted:
            return
        try:
            with self.store.lease(step) as snap:
                if snap is not None:
                    self._push(snap)
                    self.acked_step = snap.step
        except (HpctError, OSError) as exc:
            self._failed(step, exc)

    def _connect(self) -> None:
        if self._sock is None:
            sock = _connect(self.peer, self.timeout)
            with self._sock_lock:
                if self._aborted:
                    sock.close()
                    raise HpctError("the pusher was aborted")
                self._sock = sock
            self._chan = P.client_hello(self._sock, self.secret, self.job_id, self.timeout)

    def _push(self, snap: Snapshot) -> None:
        self._connect()
        assert self._sock is not None and self._chan is not None
        push_replica(self._sock, self._chan, self.rank, snap, self.timeout)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._chan = None

    def flush(self) -> None:
        """Wait until every queued push has finished (or failed)."""
        self._due.flush()

    def abort(self) -> None:
        """End now: a push still waiting for its acknowledgement is cut off rather than waited
        for (a holder that died would keep it waiting for the whole timeout); the holder
        drops a torn frame and keeps its previous copy."""
        with self._sock_lock:
            self._aborted = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._due.close()
        self._drop()

    def close(self) -> None:
        self._due.close()
        if self._sock is not None and self._chan is not None:
            with contextlib.suppress(P.ProtocolError, OSError):
                self._chan.send(self._sock, P.Goodbye("closing"), timeout=self.timeout)
        self._drop()
