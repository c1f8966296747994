"""A lost rank's state pulled from every source at once, each stripe verified on arrival.

Under plain data parallelism every survivor holds the same shared state (every replica of a
shard key does in a sharded job), so a replacement need not wait for one of them to send all of
it: `fetch_striped` asks the first source that answers for the snapshot's manifest (its layout
and the leaf digests of its part digest, sealed with the snapshot, see protocol/digest.py), then
pulls leaf-aligned stripes of the data from all sources in parallel, one connection and one
thread per source, each stripe straight into its place in one buffer.

Every stripe is checked twice on arrival, for the price of hashing each byte once: the wire
layer hashes it against the digest in its authenticated header (the sender computed that from
its sealed leaves, no hashing: `P.range_digest`), and that digest must equal the one the
manifest's leaves give for the same range, so a source whose memory rotted, or that holds
another state, is caught at its first bad stripe. Such a source, or one that dies or stalls, is
dropped (`transfer.source_dropped`) and its stripe goes back to the others; the pull fails only
when no source is left.

The server side (`serve_part`) is what `TransferServer` does for a FetchState whose `part` is
"manifest" or "range".
"""
from __future__ import annotations

import collections
import contextlib
import hmac
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import protocol as P
from ..errors import HpctError
from ..events import Ev, EventLog
from .copies import as_flat_u8, as_memoryview
from .encoding import Layout
from .peer_socket import Address, connect
from .slots import Snapshot

# Bytes per request: a whole number of leaves (P.CHUNK). Small enough that 100 MB spreads
# over several sources and a dropped source's stripe is cheap to fetch again, big enough that
# the request round trip is noise next to the copy.
STRIPE = 2 * P.CHUNK
LAYOUT_MAX = 64 * 1024 * 1024
DIGEST_BYTES = 32


@dataclass(frozen=True)
class Manifest:
    """What a source says the snapshot is: its step, layout, size and leaf digests."""
    step: int
    layout: Layout
    nbytes: int
    leaves: list[bytes]
    source: str

    def stripes(self, size: int = STRIPE) -> list[tuple[int, int]]:
        """(offset, length) of every stripe, leaf-aligned, covering all the data."""
        if size <= 0 or size % P.CHUNK:
            raise HpctError(f"stripe size {size} must be a positive multiple of {P.CHUNK}")
        return [(off, min(size, self.nbytes - off)) for off in range(0, self.nbytes, size)]

    def digest_of(self, offset: int, length: int) -> bytes:
        return P.range_digest(self.leaves, self.nbytes, offset, length)


# --- the server side -------------------------------------------------------------------------

def serve_part(sock: socket.socket, chan: P.Channel, rank: int, snap: Snapshot,
               msg: P.FetchState, timeout: float | None) -> None:
    """Answer a FetchState for the manifest or a range of `snap` (held under a lease). Costs no
    hashing where the snapshot's leaves are kept (sealed in this process); a manifest of one
    not sealed yet hashes it once. A range of a copy not sealed here goes out under the digest
    the manifest gives for it (`msg.digest`): the receiver hashes every byte against it, so a
    copy that differs is caught there, without this source hashing anything."""
    n = len(snap.data)
    if msg.part == "manifest":
        leaves = snap.leaves()
        layout_json = snap.layout.to_json()
        chan.send(sock, P.StateBlob(rank, snap.step, n, len(layout_json), "manifest"),
                  [layout_json, b"".join(leaves)], timeout)
        return
    try:
        if snap.has_leaves or not msg.digest:
            digest = P.range_digest(snap.leaves(), n, msg.offset, msg.length)
        else:
            P.range_digest([], n, msg.offset, msg.length)  # the same alignment checks
            digest = bytes.fromhex(msg.digest)
            if len(digest) != DIGEST_BYTES:
                raise ValueError(f"a digest is {DIGEST_BYTES} bytes, got {len(digest)}")
    except ValueError as exc:
        chan.send(sock, P.Ack(False, f"bad range: {exc}"), timeout=timeout)
        return
    data = snap.data[msg.offset:msg.offset + msg.length]
    writer = chan.writer(sock, P.StateBlob(rank, snap.step, n, 0, "range", msg.offset),
                         [0, len(data)], [P.part_digest(b""), digest], timeout)
    writer.write(data)
    writer.finish()


# --- the client side -------------------------------------------------------------------------

class _Source:
    """One source's connection, opened on first use and kept for all its stripes."""

    def __init__(self, addr: Address, rank: int, secret: bytes, job_id: str, timeout: float):
        # `rank`: whose snapshot to ask this source for (its own, under the shared state)
        self.addr, self.rank, self.secret, self.job_id = addr, rank, secret, job_id
        self.timeout = timeout
        self.name = f"{addr[0]}:{addr[1]}"
        self.sock: socket.socket | None = None
        self.chan: P.Channel | None = None
        self.bytes = 0
        # One stream of several: hash its stripes' leaves in its own thread as they arrive
        # (the other streams are the overlap; digest.PartHasher). Alone, on the hash pool.
        self.inline_hash = False

    def request(self, msg: P.FetchState, sink: P.BodySink, max_body: int) -> P.Envelope:
        if self.sock is None:
            self.sock = connect(self.addr, self.timeout)
            self.chan = P.client_hello(self.sock, self.secret, self.job_id, self.timeout)
        assert self.chan is not None
        self.chan.send(self.sock, msg, timeout=self.timeout)
        try:
            env = self.chan.recv(self.sock, timeout=self.timeout, max_body=max_body,
                                 body_sink=sink, inline_hash=self.inline_hash)
        except P.DigestMismatch as exc:
            raise HpctError(f"digest mismatch: {exc.message}") from None
        if isinstance(env.msg, P.Ack):
            raise HpctError(f"source refused: {env.msg.detail}")
        if not isinstance(env.msg, P.StateBlob):
            raise HpctError(f"source answered {env.msg.TYPE} instead of state_blob")
        return env

    def close(self) -> None:
        if self.sock is not None:
            if self.chan is not None:
                with contextlib.suppress(P.ProtocolError, OSError):
                    self.chan.send(self.sock, P.Goodbye("done"), timeout=1.0)
            self.sock.close()
            self.sock = None


def _reason(exc: BaseException) -> str:
    return exc.message if isinstance(exc, HpctError) else f"{type(exc).__name__}: {exc}"


def fetch_manifest(src: _Source, step: int) -> Manifest:
    parts: dict[str, bytearray] = {}

    def sink(msg: Any, sizes: Any) -> list[memoryview]:
        if isinstance(msg, P.StateBlob) and msg.part == "manifest":
            n_leaves = -(-msg.nbytes // P.CHUNK)
            if list(sizes) != [msg.layout_nbytes, n_leaves * DIGEST_BYTES] or \
                    msg.layout_nbytes > LAYOUT_MAX:
                raise P.ProtocolError(f"manifest parts {list(sizes)} do not fit "
                                      f"{msg.nbytes} bytes of state")
        parts["layout"], parts["leaves"] = (bytearray(sizes[0]) if sizes else bytearray(),
                                            bytearray(sizes[1]) if len(sizes) > 1 else bytearray())
        return [memoryview(parts["layout"]), memoryview(parts["leaves"])][:len(sizes)]

    env = src.request(P.FetchState(src.rank, step, "own", "manifest"), sink, 2 * LAYOUT_MAX)
    msg = env.msg
    if msg.part != "manifest" or msg.rank != src.rank or msg.step != step:
        raise HpctError(f"source sent {msg.part} of rank {msg.rank} step {msg.step}, asked for "
                        f"the manifest of rank {src.rank} step {step}")
    layout = Layout.from_json(bytes(parts["layout"]))
    if layout.nbytes != msg.nbytes:
        raise HpctError(f"layout says {layout.nbytes} bytes, the manifest {msg.nbytes}")
    raw = bytes(parts["leaves"])
    leaves = [raw[i:i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES)]
    return Manifest(msg.step, layout, msg.nbytes, leaves, src.name)


class _Pull:
    """The shared work of one striped pull: stripes still to fetch, in flight, and done."""

    def __init__(self, manifest: Manifest, buf: torch.Tensor, stripe: int):
        self.m = manifest
        self.view = as_memoryview(as_flat_u8(buf))
        self.todo = collections.deque(manifest.stripes(stripe))
        self.in_flight = 0
        self.cond = threading.Condition()
        self.failures: list[str] = []

    def take(self) -> tuple[int, int] | None:
        """The next stripe, waiting while others are in flight (one may come back)."""
        with self.cond:
            while not self.todo and self.in_flight:
                self.cond.wait()
            if not self.todo:
                return None
            self.in_flight += 1
            return self.todo.popleft()

    def settle(self, stripe: tuple[int, int], ok: bool) -> None:
        with self.cond:
            self.in_flight -= 1
            if not ok:
                self.todo.appendleft(stripe)
            self.cond.notify_all()


def _fetch_stripe(src: _Source, pull: _Pull, off: int, length: int) -> None:
    m = pull.m

    def sink(msg: Any, sizes: Any) -> list[memoryview]:
        if not isinstance(msg, P.StateBlob):  # a refusal (Ack): request() says why
            return [memoryview(bytearray(n)) for n in sizes]
        if not (msg.part == "range" and msg.offset == off and list(sizes) == [0, length]):
            raise P.ProtocolError(f"asked for {length} bytes at {off}, the source offers "
                                  f"{list(sizes)} at {getattr(msg, 'offset', '?')}")
        return [memoryview(b""), pull.view[off:off + length]]

    want = m.digest_of(off, length)
    env = src.request(P.FetchState(src.rank, m.step, "own", "range", off, length, want.hex()),
                      sink, length + 1)
    if env.msg.step != m.step or env.msg.nbytes != m.nbytes:
        raise HpctError(f"source holds step {env.msg.step} ({env.msg.nbytes} bytes), the "
                        f"manifest step {m.step} ({m.nbytes} bytes)")
    # The wire checked the bytes against the source's digest; this checks that digest against
    # the manifest's: the source's copy is the state the manifest describes.
    if not hmac.compare_digest(bytes(env.digests[1]), want):
        raise HpctError(f"stripe at {off} does not match the manifest from {m.source}")
    src.bytes += length


def _worker(src: _Source, pull: _Pull, rank: int, events: EventLog | None) -> None:
    while True:
        stripe = pull.take()
        if stripe is None:
            return
        try:
            _fetch_stripe(src, pull, *stripe)
        except (HpctError, OSError, P.ProtocolError) as exc:
            pull.settle(stripe, ok=False)
            reason = _reason(exc)
            pull.failures.append(f"{src.name} ({reason})")
            if events:
                events.emit(Ev.TRANSFER_SOURCE_DROPPED, rank=rank, step=pull.m.step,
                            source=src.name, offset=stripe[0], error=reason)
            src.close()
            return
        pull.settle(stripe, ok=True)


@dataclass
class StripedResult:
    step: int
    layout: Layout
    data: Any
    source: str                  # "host:port[,host:port...]": those that delivered stripes
    per_source: dict[str, int]   # bytes each source delivered
    # the manifest's leaf digests, which every stripe of `data` was checked against: the
    # pulled buffer is sealed with them (SnapshotStore.adopt) without hashing it again
    leaves: list[bytes] = field(default_factory=list)


def fetch_striped(sources: list[tuple[int, Address]], rank: int, secret: bytes, job_id: str,
                  step: int, into: Any = None, timeout: float = 60.0,
                  events: EventLog | None = None, stripe: int = STRIPE) -> StripedResult:
    """The shared state `rank` needs, at exactly `step`, pulled from all `sources` at once
    ((source rank, address): each is asked for its own snapshot, the same bytes under plain
    data parallelism or within a shard key; see the module docstring). Raises HpctError
    naming every failure when no source can finish it."""
    if step < -1:
        raise HpctError(f"a striped pull needs an exact step, got {step}")
    t0 = time.perf_counter()
    srcs = [_Source((str(a[0]), int(a[1])), int(r), secret, job_id, timeout)
            for r, a in sources]
    failures: list[str] = []
    manifest = None
    try:
        for src in list(srcs):
            try:
                manifest = fetch_manifest(src, step)
                break
            except (HpctError, OSError, P.ProtocolError) as exc:
                failures.append(f"{src.name} ({_reason(exc)})")
                if events:
                    events.emit(Ev.TRANSFER_SOURCE_FAILED, rank=rank, step=step,
                                source=src.name, error=_reason(exc))
                src.close()
                srcs.remove(src)
        if manifest is None:
            raise HpctError(f"no source has rank {rank}'s state at step {step}: "
                            + ("; ".join(failures) or "no sources"))
        buf = into
        if buf is None or as_flat_u8(buf).numel() < manifest.nbytes:
            buf = torch.empty(manifest.nbytes, dtype=torch.uint8)
        pull = _Pull(manifest, buf, stripe)
        for s in srcs:
            s.inline_hash = len(srcs) > 1
        threads = [threading.Thread(target=_worker, args=(s, pull, rank, events), daemon=True,
                                    name=f"hpct-stripe-{i}") for i, s in enumerate(srcs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if pull.todo:
            raise HpctError(f"every source failed before rank {rank}'s state at step {step} "
                            f"was complete ({len(pull.todo)} stripes left): "
                            + "; ".join(failures + pull.failures))
    finally:
        for s in srcs:
            s.close()
    per_source = {s.name: s.bytes for s in srcs if s.bytes}
    if events:
        events.emit(Ev.TRANSFER_STRIPED, rank=rank, step=manifest.step, nbytes=manifest.nbytes,
                    sources=per_source, dropped=len(pull.failures),
                    seconds=round(time.perf_counter() - t0, 4))
    return StripedResult(manifest.step, manifest.layout, buf,
                         ",".join(sorted(per_source)), per_source, manifest.leaves)


class Prefetch:
    """A striped pull run in the background, e.g. while the new group forms: a replacement
    needs no process group to pull its state. `result()` waits for it and gives None when it
    failed (the event says why): the caller then tries its sources one by one, as before."""

    def __init__(self, sources: list[tuple[int, Address]], rank: int, secret: bytes,
                 job_id: str, step: int, events: EventLog | None = None,
                 timeout: float = 60.0):
        self._out: list[StripedResult] = []
        self._error = ""
        self.events, self.rank, self.step = events, rank, step

        def run() -> None:
            try:
                self._out.append(fetch_striped(sources, rank, secret, job_id, step,
                                               timeout=timeout, events=events))
            except (HpctError, OSError, P.ProtocolError) as exc:
                self._error = _reason(exc)

        self._thread = threading.Thread(target=run, daemon=True, name="hpct-prefetch")
        self._thread.start()

    def result(self) -> StripedResult | None:
        self._thread.join()
        if not self._out and self.events:
            self.events.emit(Ev.TRANSFER_SOURCE_FAILED, rank=self.rank, step=self.step,
                             source="striped", error=self._error)
        return self._out[0] if self._out else None
