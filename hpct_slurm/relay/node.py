"""A node relay: one connection to the controller for all of a node's ranks (issue 16).

Without it a recovery round costs the controller ~5 authenticated messages per rank (STOP,
Holdings, ready, Assign, the first step's report) through one Python event loop; at 16,384
ranks that is ~80,000 messages and seconds of a core. When a node runs several ranks the
controller sets HPCT_RELAY=1 in its steps, and then:

* the node's first local rank also runs this relay: a listening socket on 127.0.0.1 for the
  node's ranks, and one connection to the controller, opened with a `RelayHello`;
* every local rank (the first one too) connects its unchanged `CoordinationClient` to the relay
  instead of the controller and speaks the same per-rank protocol to it: the relay is the
  server of those connections (its own nonce, `Channel` sequence numbers and directions,
  the job's secret), so every frame on every hop is authenticated;
* upwards, the relay forwards its ranks' messages in `Batch` frames, as coalesce.py decides
  (the node's 8 ready reports after a STOP leave as one frame; routine heartbeats once per
  interval); a rank's connection ending becomes a `Left` item, which the controller treats
  like that rank's own connection ending;
* downwards, the controller's Batch (a STOP, the Assigns, Goodbyes for the node's ranks) is
  fanned out to each rank's own connection.

The node is the unit of failure already (the controller replaces nodes): the relay's process
ending ends the controller connection of the node's ranks, which the controller sees as the
node lost, and a rank's own loss reaches it as `Left` while the relay lives.

The other local ranks find the relay's port in a file the first one writes into the private
run directory (`relay_file`): only the job's user can write there, and a stranger who
connects to the port anyway cannot authenticate. Another user on the node can still connect,
so a connection is a stranger until its first frame authenticates, like the transfer server's
and the store's: it has AUTH_TIMEOUT_S to send it, at most MAX_STRANGERS are held (the oldest
makes room for a newcomer), and running out of descriptors pauses accepting, never ends it.

What the relay cannot forward it refuses, cutting the one local rank that sent it (the
controller hears that rank's loss as Left) rather than the node's link: a message too big to
wrap in a Batch, or one of the relay's own messages (a Batch, a RelayHello, a Left) from a
rank. An unexpected error in one of its threads is recorded (`relay.failed`) and takes the
relay down, so that the node's ranks and the controller see their connections end instead of
waiting on a relay that silently stopped forwarding.
"""
from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import config as C
from .. import protocol as P
from ..accept_pause import AcceptPause
from ..errors import HpctError
from ..events import Ev, EventLog
from ..fdlimit import raise_nofile
from ..rundir import private_dir, write_private
from .coalesce import WINDOW_S, Coalescer

# recovery.client is imported where it is used, not here: any recovery module runs
# recovery/__init__.py first, which imports job.py, which imports this module, so at the top a
# first `import hpct_slurm.relay.node` would meet itself half-made (tests/test_import_floors.py).
if TYPE_CHECKING:
    from ..recovery.client import ControllerAddress

# A new connection is a stranger until its first frame (a local rank's Register) authenticates:
# that frame must arrive within AUTH_TIMEOUT_S, and at MAX_STRANGERS the oldest stranger makes
# room for a newcomer. The node's ranks are on the same node and register as they connect;
# each connection is a thread and a descriptor of the training process, which another user's
# crowd of idle connections must not use up.
AUTH_TIMEOUT_S = 5.0
MAX_STRANGERS = 64
# Longest pause between accept retries while the process is out of descriptors or memory.
ACCEPT_BACKOFF_MAX = 1.0
# How long the relay waits, when its own rank leaves, for the node's other ranks to leave
# first (the Goodbyes it fans out must reach them before this process ends).
CLOSE_WAIT_S = 5.0
# A send to a local rank blocks only once its socket buffers are full: the rank has stopped
# reading (hung, or stopped by a signal). The relay's one downward thread must not wait on it
# forever, or the node's other ranks would never hear a STOP or an Assign: past this long the
# rank is cut off, and its loss goes up as Left, as if its connection had failed.
DELIVER_TIMEOUT_S = 10.0
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
# The relay's own messages: a local rank that sends one is refused (the controller would take a
# nested Batch or RelayHello for a broken relay and drop the node's link, a Left for that rank's
# loss while it lives).
_RELAY_OWN = (P.Batch, P.RelayHello, P.Left)


def relay_file(run_dir: Path, job_id: str, restart_count: int, step_id: int | None,
               node: str) -> Path:
    """Where a node's relay publishes its port: one name per job run (a requeued job starts
    its step ids again), step and node, so a file from an earlier step is never read."""
    if not _NAME_RE.fullmatch(node):
        raise HpctError(f"node name {node!r:.80} cannot name a relay file")
    step = "x" if step_id is None else str(step_id)
    return Path(run_dir) / "relay" / f"{job_id}.{restart_count}.{step}.{node}"


def publish(path: Path, address: tuple[str, int]) -> None:
    private_dir(path.parent, "relay dir")
    write_private(path, f"{address[0]}:{address[1]}".encode())


def published(path: Path, timeout: float) -> ControllerAddress:
    """The relay address the node's first rank wrote to `path`, waiting up to `timeout` for
    it (that rank may still be importing torch)."""
    from ..recovery.client import ControllerAddress  # here: see the imports above
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ControllerAddress.parse(path.read_text().strip(), var=str(path))
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise HpctError(f"no node relay published {path} within {timeout:.0f} s "
                                f"(the node's first local rank did not start it)") from None
            time.sleep(0.1)


@dataclass
class _Local:
    """One local rank's connection to the relay."""
    sock: socket.socket
    chan: P.Channel
    lock: threading.Lock = field(default_factory=threading.Lock)
    cut: bool = False  # a send failed: nothing more goes to it (its Left is on the way)


class NodeRelay:
    """The relay in the node's first local rank's process: threads and blocking sockets, like
    CoordinationClient. `address` is where the node's ranks connect."""

    def __init__(self, controller: ControllerAddress, secret: bytes, job_id: str, node: str,
                 role: str, own_local_rank: int, events: EventLog | None = None,
                 tick_s: float | None = None, window_s: float = WINDOW_S,
                 connect_timeout: float = 60.0, auth_timeout: float = AUTH_TIMEOUT_S,
                 max_strangers: int = MAX_STRANGERS):
        from ..recovery.client import HEARTBEAT_S, CoordinationClient  # see the imports above
        raise_nofile()  # a rank already did (job.py); a relay started on its own does it here
        self.secret, self.job_id, self.node, self.own = secret, job_id, node, own_local_rank
        self.events = events or EventLog()
        # routine messages go up once per heartbeat interval (the controller's pacing)
        tick = tick_s or C.read(os.environ, C.HEARTBEAT_S) or HEARTBEAT_S
        self._co = Coalescer(tick, window_s)
        self._cond = threading.Condition()
        self._local: dict[int, _Local] = {}
        self.closed = threading.Event()
        self.auth_timeout, self.max_strangers = auth_timeout, max_strangers
        # Connections not authenticated yet, oldest first; a paused accept waits on _freed.
        self._strangers: dict[socket.socket, None] = {}
        self._lock = threading.Lock()
        self._freed = threading.Event()
        self._up, self._up_chan = CoordinationClient._connect(controller, secret, job_id,
                                                              connect_timeout)
        self._up_chan.send(self._up, P.RelayHello(job_id, node, role, os.getpid()))
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        for target, name in ((self._accept_loop, "hpct-relay-accept"),
                             (self._read_up, "hpct-relay-rx"),
                             (self._flush_loop, "hpct-relay-tx")):
            threading.Thread(target=self._guarded, args=(target, name), daemon=True,
                             name=name).start()
        self._emit(Ev.RELAY_START, address=f"{self.address[0]}:{self.address[1]}")

    def _emit(self, event: str, **fields: Any) -> bool:
        """Record an event; False when it could not be written. The log is a file opened per
        event, which fails while the process is out of descriptors: that must never end the
        thread that was only saying so."""
        try:
            self.events.emit(event, node=self.node, **fields)
            return True
        except (HpctError, OSError):
            return False

    def _guarded(self, target: Callable[[], None], name: str) -> None:
        """One of the relay's own threads. Each handles what a peer can do to it; anything else
        is a bug, and a relay with a dead thread would go on looking alive (no more heartbeats
        up, or no STOP down) until the controller fenced the node as hung: fail loudly."""
        try:
            target()
        except Exception as exc:
            self._fail(name, exc)

    def _fail(self, thread: str, exc: Exception) -> None:
        """Take the relay down: the controller sees the node's link end, the reader thread cuts
        every local rank's connection as it ends (each rank sees its own end), and no new rank
        gets in."""
        self._emit(Ev.RELAY_FAILED, thread=thread, error=f"{type(exc).__name__}: {exc}")
        with self._cond:
            self.closed.set()
            self._cond.notify_all()
        self._freed.set()
        _shutdown(self._listener)
        _shutdown(self._up)

    @property
    def upstream_fd(self) -> int:
        """The controller connection's fd: a rank that cuts connections on a STOP (sever.py)
        must keep it, like its own."""
        return self._up.fileno()

    # ---- the node's ranks -> the controller ----------------------------------------------
    def _accept_loop(self) -> None:
        # Out of descriptors (EMFILE/ENFILE: another user's connections, or the training's own
        # files) or memory: returning would leave the node's ranks unable to reach the relay
        # for good; pause, say so once, and accept again (accept_pause.py).
        pause = AcceptPause(lambda **f: self._emit(Ev.RELAY_ACCEPT_FAILED, **f), self.events,
                            max_s=ACCEPT_BACKOFF_MAX)
        while not self.closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError as exc:
                if self.closed.is_set():
                    return
                self._freed.wait(pause.failed(exc))
                self._freed.clear()
                continue
            pause.accepted()
            self._admit(sock, f"{peer[0]}:{peer[1]}")

    def _admit(self, sock: socket.socket, peer: str) -> None:
        """Give `sock` a thread, making room at the cap by dropping the oldest connection that
        has not authenticated: strangers holding connections open cannot lock out the node's
        ranks, nor use up the process's threads and descriptors."""
        with self._lock:
            full = len(self._strangers) >= self.max_strangers
            if full:
                oldest = next(iter(self._strangers))
                del self._strangers[oldest]
                _shutdown(oldest)  # its thread sees the connection end, and closes it
            self._strangers[sock] = None
        if full:
            self._emit(Ev.RELAY_CONNECTION_EVICTED, peer=peer,
                       error=f"at the cap of {self.max_strangers} connections not "
                             f"authenticated: dropped the oldest one")
        try:
            threading.Thread(target=self._serve_local, args=(sock,), daemon=True,
                             name="hpct-relay-local").start()
        except RuntimeError as exc:  # no thread could be started
            with self._lock:
                self._strangers.pop(sock, None)
            sock.close()
            self._emit(Ev.RELAY_REJECTED, peer=peer, error=str(exc))

    def _serve_local(self, sock: socket.socket) -> None:
        lr: int | None = None
        authentic = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            chan = P.server_hello(sock, self.secret, self.job_id, timeout=self.auth_timeout)
            r = chan.recv(sock, timeout=self.auth_timeout).msg
            authentic = True
            with self._lock:
                self._strangers.pop(sock, None)
            if not isinstance(r, P.Register) or r.node != self.node:
                raise P.ProtocolError(f"the first message on a relay of {self.node} must be a "
                                      f"Register of that node, got {r.TYPE} "
                                      f"{getattr(r, 'node', '')!r:.80}")
            sock.settimeout(None)
            # Only sends time out (the kernel's SO_SNDTIMEO): reads wait for the rank as long
            # as it lives.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(DELIVER_TIMEOUT_S))
            with self._cond:
                if r.local_rank in self._local:
                    raise P.ProtocolError(f"local rank {r.local_rank} is already registered")
                self._local[r.local_rank] = _Local(sock, chan)
                lr = r.local_rank
                self._add(lr, r)
            while True:
                msg = chan.recv(sock).msg
                if isinstance(msg, _RELAY_OWN):
                    self._refuse(lr, msg, f"a {msg.TYPE} is the relay's own message: a local "
                                          f"rank's connection carries only that rank's")
                    return
                with self._cond:
                    self._add(lr, msg)
        except P.ConnectionClosed:
            pass
        except (HpctError, OSError) as exc:
            # A registered rank's connection failing is its loss, which goes up as Left; a
            # connection refused before it registered is the relay's to record (not one
            # evicted at the cap: that was recorded then).
            with self._lock:
                evicted = not authentic and sock not in self._strangers
            if lr is None and not evicted and not self.closed.is_set():
                self._emit(Ev.RELAY_REJECTED, error=str(exc))
        except Exception as exc:  # a bug: this connection ends (its rank's Left goes up)
            self._emit(Ev.RELAY_FAILED, thread="hpct-relay-local", local_rank=lr,
                       error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._strangers.pop(sock, None)
            sock.close()
            self._freed.set()
            if lr is not None:
                with self._cond:
                    self._local.pop(lr, None)
                    self._add(lr, P.Left("connection lost"))

    def _refuse(self, lr: int, msg, why: str) -> None:
        """A message from local rank `lr` that must not go up: record it and cut that rank's
        connection (its thread sends its Left up: the controller hears the rank's loss, and
        the rank its connection end); the node's link and other ranks go on."""
        self._emit(Ev.RELAY_RANK_REFUSED, local_rank=lr, type=msg.TYPE, error=why)
        with self._cond:
            loc = self._local.get(lr)
        if loc is not None:
            # Without loc.lock: a send to it may hold that for DELIVER_TIMEOUT_S, and the
            # shutdown fails such a send at once anyway.
            loc.cut = True
            _shutdown(loc.sock)

    def _add(self, lr: int, msg) -> None:
        """Under self._cond."""
        self._co.add(lr, msg, time.monotonic())
        self._cond.notify_all()

    def _flush_loop(self) -> None:
        # The only sender upstream, so the Channel's sequence numbers go out in order.
        while True:
            with self._cond:
                while True:
                    left = self._co.wait_s(time.monotonic())
                    if left == 0.0 or (self.closed.is_set() and left is None):
                        break
                    self._cond.wait(left)
                if left is None:
                    return  # closed, and nothing left to send
                frames, refused = self._encode(self._co.take(time.monotonic()))
            for lr, msg, why in refused:
                self._refuse(lr, msg, why)
            try:
                for frame in frames:
                    self._up.sendall(frame)
            except OSError:
                # The stream may end half-way into a frame: cut it, so that the reader sees
                # the controller connection fail (and the node's ranks hear it).
                _shutdown(self._up)
                return

    def _encode(self, pairs: list[tuple[int, Any]]
                ) -> tuple[list[bytes], list[tuple[int, Any, str]]]:
        """Under self._cond: `pairs` as Batch frames, less each message that does not fit in
        a Batch even alone (a rank's frame just under HEADER_MAX is over it once wrapped, and
        the controller takes nothing but Batches from a relay): those come back, with why, to
        be refused. Each one tried alone skips a sequence number, which is allowed (they must
        only increase)."""
        try:
            return self._up_chan.encode_batch(pairs), []
        except P.HeaderTooLarge:
            pass
        fits, refused = [], []
        for lr, msg in pairs:
            try:
                self._up_chan.encode(P.Batch.of([(lr, msg)]))
                fits.append((lr, msg))
            except P.HeaderTooLarge as exc:
                refused.append((lr, msg, f"too big to go up in a batch: {exc}"))
        return (self._up_chan.encode_batch(fits) if fits else []), refused

    # ---- the controller -> the node's ranks ----------------------------------------------
    def _read_up(self) -> None:
        try:
            while True:
                msg = self._up_chan.recv(self._up).msg
                if not isinstance(msg, P.Batch):
                    raise P.ProtocolError(f"a relay expects batches, got {msg.TYPE}")
                # its own rank's last: that process (this relay's) may end the moment its
                # rank reads a Goodbye, and the others' must be on their way by then
                for lr, m in sorted(msg.messages(), key=lambda p: p[0] == self.own):
                    self._deliver(lr, m)
        except P.ConnectionClosed:
            pass
        except (HpctError, OSError) as exc:
            if not self.closed.is_set():
                self._emit(Ev.RELAY_CONTROLLER_LOST, error=str(exc))
        finally:
            # The ranks behind a lost link hear it as their own connection ending (a rank
            # then checks whether the controller itself is gone, as it would without us).
            with self._cond:
                locals_ = list(self._local.values())
            for loc in locals_:
                with loc.lock:
                    _shutdown(loc.sock)

    def _deliver(self, lr: int, msg) -> None:
        with self._cond:
            loc = self._local.get(lr)
        if loc is None:
            return  # it left: its Left is on the way to the controller
        with loc.lock:
            if loc.cut:
                return
            try:
                loc.chan.send(loc.sock, msg)
            except (HpctError, OSError) as exc:
                # Failed, or timed out half-way into a frame (the stream is lost either way):
                # cut it, so that its reader thread ends and reports it Left.
                loc.cut = True
                _shutdown(loc.sock)
                self._emit(Ev.RELAY_RANK_CUT, local_rank=lr, error=str(exc))

    # ---- the end -------------------------------------------------------------------------
    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Once the relay's own rank has left: wait (bounded) for the node's other ranks to
        leave and for what they said last to go up, then close the controller connection."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while (self._local or self._co.items) and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self.closed.set()
            self._cond.notify_all()
        self._freed.set()
        _shutdown(self._listener)  # wakes the accept loop (closing alone does not)
        self._listener.close()
        _shutdown(self._up)
        self._up.close()


def _timeval(seconds: float) -> bytes:
    """A struct timeval, as SO_SNDTIMEO takes it."""
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1_000_000))


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
