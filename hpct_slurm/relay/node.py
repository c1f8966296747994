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
connects to the port anyway cannot authenticate.
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
from typing import TYPE_CHECKING

from .. import config as C
from .. import protocol as P
from ..errors import HpctError
from ..events import Ev, EventLog
from ..rundir import private_dir, write_private
from .coalesce import WINDOW_S, Coalescer

# recovery.client is imported where it is used, not here: any recovery module runs
# recovery/__init__.py first, which imports job.py, which imports this module, so at the top a
# first `import hpct_slurm.relay.node` would meet itself half-made (tests/test_import_floors.py).
if TYPE_CHECKING:
    from ..recovery.client import ControllerAddress

# A local rank that connected must register within this long (it is on the same node).
REGISTER_TIMEOUT_S = 30.0
# How long the relay waits, when its own rank leaves, for the node's other ranks to leave
# first (the Goodbyes it fans out must reach them before this process ends).
CLOSE_WAIT_S = 5.0
# A send to a local rank blocks only once its socket buffers are full: the rank has stopped
# reading (hung, or stopped by a signal). The relay's one downward thread must not wait on it
# forever, or the node's other ranks would never hear a STOP or an Assign: past this long the
# rank is cut off, and its loss goes up as Left, as if its connection had failed.
DELIVER_TIMEOUT_S = 10.0
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


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
                 connect_timeout: float = 60.0):
        from ..recovery.client import HEARTBEAT_S, CoordinationClient  # see the imports above
        self.secret, self.job_id, self.node, self.own = secret, job_id, node, own_local_rank
        self.events = events or EventLog()
        # routine messages go up once per heartbeat interval (the controller's pacing)
        tick = tick_s or C.read(os.environ, C.HEARTBEAT_S) or HEARTBEAT_S
        self._co = Coalescer(tick, window_s)
        self._cond = threading.Condition()
        self._local: dict[int, _Local] = {}
        self.closed = threading.Event()
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
            threading.Thread(target=target, daemon=True, name=name).start()
        self.events.emit(Ev.RELAY_START, node=node,
                         address=f"{self.address[0]}:{self.address[1]}")

    @property
    def upstream_fd(self) -> int:
        """The controller connection's fd: a rank that cuts connections on a STOP (sever.py)
        must keep it, like its own."""
        return self._up.fileno()

    # ---- the node's ranks -> the controller ----------------------------------------------
    def _accept_loop(self) -> None:
        while not self.closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve_local, args=(sock,), daemon=True,
                             name="hpct-relay-local").start()

    def _serve_local(self, sock: socket.socket) -> None:
        lr: int | None = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            chan = P.server_hello(sock, self.secret, self.job_id, timeout=5)
            r = chan.recv(sock, timeout=REGISTER_TIMEOUT_S).msg
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
                with self._cond:
                    self._add(lr, msg)
        except P.ConnectionClosed:
            pass
        except (HpctError, OSError) as exc:
            # A registered rank's connection failing is its loss, which goes up as Left; a
            # connection refused before it registered is the relay's to record.
            if lr is None and not self.closed.is_set():
                self.events.emit(Ev.RELAY_REJECTED, node=self.node, error=str(exc))
        finally:
            sock.close()
            if lr is not None:
                with self._cond:
                    self._local.pop(lr, None)
                    self._add(lr, P.Left("connection lost"))

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
                frames = self._up_chan.encode_batch(self._co.take(time.monotonic()))
            try:
                for frame in frames:
                    self._up.sendall(frame)
            except OSError:
                return  # the reader sees the controller connection fail

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
                self.events.emit(Ev.RELAY_CONTROLLER_LOST, node=self.node, error=str(exc))
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
                self.events.emit(Ev.RELAY_RANK_CUT, node=self.node, local_rank=lr,
                                 error=str(exc))

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
