"""Rank side of the coordination protocol: register, heartbeat, receive STOP and assignments.

One background thread owns the socket's receive side; the training thread only reads flags and
queues, so a STOP is seen at the next step boundary even while training is busy, and a hung
training thread still lets heartbeats stop (the controller then fences it).
"""
from __future__ import annotations

import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .. import config as C
from .. import protocol as P
from ..protocol.pacing import set_keepalive, should_report
from ..errors import HpctError
from ..events import Ev, EventLog
from .own_time import OwnTime
from .sever import sever

HEARTBEAT_S = 0.5
# A controller whose host died without a word (power, kernel, link: no FIN ever comes) leaves
# a rank's heartbeats unacknowledged: after this long the kernel fails the connection and the
# rank learns what a closed one would have told it (seen on the cluster: without it the
# survivors of a silent batch-host loss waited on the dead connection, and no one requeued).
CONTROLLER_SILENCE_S = 10.0


@dataclass(frozen=True)
class ControllerAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, var: str = "HPCT_CONTROLLER") -> "ControllerAddress":
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise HpctError(f"{var} {text!r} is not host:port")
        return cls(host, int(port))


class CoordinationClient:
    """A rank's connection to the controller."""

    def __init__(self, address: ControllerAddress, secret: bytes, job_id: str,
                 events: EventLog | None = None, connect_timeout: float = 60.0):
        self.secret, self.job_id = secret, job_id
        self.events = events or EventLog()
        self._send_lock = threading.Lock()
        self._sock, self._chan = self._connect(address, secret, job_id, connect_timeout)
        self.assignments: "queue.Queue[P.Assign | P.Goodbye]" = queue.Queue()
        self.stop_event = threading.Event()
        self.stop_reason = ""
        self.stop_generation = -1
        # The STOP names lost nodes: the step in progress can never complete (its collectives
        # wait for a dead peer), so a rank may abandon it before its update (Job._abandon).
        self.stop_doomed = False
        # Called from the receiving thread when a STOP arrives: a rank blocked forming its
        # group (not at a step boundary) is interrupted through it (the store's abort).
        self.on_stop: Callable[[], None] | None = None
        # Called from the receiving thread on a STOP that names lost nodes, with the STOP's
        # generation: an NCCL job aborts that generation's communicators (pg.abort_generation),
        # which no socket cut reaches. It must return within `abort_timeout_s`, or this
        # process says so and exits (`on_abort_hung`): the controller replaces it.
        self.abort_comms: Callable[[int], bool] | None = None
        self.abort_timeout_s = 10.0
        self.on_abort_hung: Callable[[str], None] = self._exit_hung
        # The other hosts of this rank's group (set at every adoption): cut on a fault's STOP,
        # and by a rank that leaves a step on its own (`leave_group`), see _read_loop.
        self.group_addrs: set[str] = set()
        # Whether a planned STOP cuts the whole group too: a job whose collectives run on
        # sub-groups or beside a carried all-reduce, where a rank leaving at its step
        # boundary may leave a peer blocked mid-step on it.
        self.cut_group_on_any_stop = False
        # Whether a whole-group cut includes what this process opened to its own node (the
        # node's other ranks are in the group: a TP pair inside the node)
        self.sever_own_node = False
        self.host_addr = ""
        # More connections a STOP's cut must never touch (a node relay's link to the
        # controller, in the process that runs it: job.py).
        self.keep_fds: set[int] = set()
        self.closed = threading.Event()
        # Called from the receiving thread when the connection ended without the controller's
        # Goodbye and without this process closing it: the controller (or its host) may be
        # gone, and the training thread may be stuck where it never asks (job.py).
        self.on_lost: Callable[[], None] | None = None
        self._bye_received = False
        self._closing = False  # this process hangs up (close): not a loss
        self.rank = -1
        self.generation = -1
        self.step = -1
        self.state = "registering"
        # The controller's pacing (controller/pacing.py): longer intervals in large worlds.
        self.heartbeat_s = C.read(os.environ, C.HEARTBEAT_S) or HEARTBEAT_S
        self.step_report_s = C.read(os.environ, C.STEP_REPORT_S) or 0.0
        self._last_report: tuple[int, float] | None = None
        # Its own time per step, which the heartbeat carries (own_time.py: fail-slow)
        self.own = OwnTime(C.read(os.environ, C.SLOW_WINDOW))
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="hpct-coord-rx")
        self._beater = threading.Thread(target=self._beat_loop, daemon=True, name="hpct-coord-hb")

    @staticmethod
    def _connect(address: ControllerAddress, secret: bytes, job_id: str,
                 timeout: float) -> tuple[socket.socket, P.Channel]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((address.host, address.port), timeout=5)
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    set_keepalive(sock, unacked_s=CONTROLLER_SILENCE_S)
                    # The controller's nonce binds every frame to this connection.
                    chan = P.client_hello(sock, secret, job_id, timeout=5)
                    sock.settimeout(None)
                except BaseException:
                    sock.close()
                    raise
                return sock, chan
            except (P.ProtocolError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise HpctError(f"cannot reach the controller at {address.host}:"
                                    f"{address.port}: {exc}") from exc
                time.sleep(0.2)

    def send(self, msg) -> None:
        # No socket timeout: the reader thread shares this socket and a timeout set for a
        # send would also end its (legitimately long) wait for the next message. Sends are
        # small and go to the kernel buffer; a dead controller shows up as an error instead.
        with self._send_lock:
            self._chan.send(self._sock, msg)

    def register(self, node: str, local_rank: int, role: str, host_addr: str,
                 transfer_port: int) -> None:
        self.host_addr = host_addr
        self.send(P.Register(self.job_id, node, local_rank, role, os.getpid(), host_addr,
                             transfer_port))
        self._reader.start()
        self._beater.start()

    def _send_or_close(self, msg) -> None:
        """Send; a failure means the controller is gone, which the training thread sees."""
        try:
            self.send(msg)
        except (HpctError, OSError):
            self.closed.set()

    def heartbeat_now(self) -> None:
        own_s, own_n = self.own.figure
        self._send_or_close(P.Heartbeat(self.rank, self.generation, self.step, self.state,
                                        round(own_s, 6), own_n))

    def report_holdings(self, msg: "P.Holdings") -> None:
        self._send_or_close(msg)

    def leave_group(self) -> None:
        """Cut this rank's connections to its whole group: it left a step on its own (its
        own error, or a peer's connection error) before any STOP. A peer blocked reading
        from it would otherwise wait out the collective timeout, since the sockets close
        only when the group's teardown runs; cut, its read fails now and it recovers too."""
        self._sever(sorted(self.group_addrs), whole=True)

    def _sever(self, addrs: list[str], whole: bool) -> None:
        """Cut our connections to `addrs` (sever.py): a collective blocked on one of them
        fails now instead of at its timeout. This node's own address only where the whole
        group is cut and the node runs more of its ranks, and then only what this process
        opened (sever's `outbound`)."""
        own = [self.host_addr] if whole and self.sever_own_node else []
        try:
            cut = sever(addrs, keep={self.host_addr},
                        keep_fds={self._sock.fileno(), *self.keep_fds}, outbound=own)
        except ValueError as exc:  # an address that is not one: nothing to cut
            self.events.emit(Ev.RANK_SEVER_FAILED, addrs=addrs, error=str(exc))
            return
        if cut:
            self.events.emit(Ev.RANK_SEVERED, addrs=addrs, connections=cut)

    def _abort(self, generation: int) -> None:
        """Abort the STOP's generation's communicators (abort_comms) on a thread of its own,
        waiting for it here at most `abort_timeout_s`: an abort stuck in a native call must not
        leave a rank that neither recovers nor dies (the controller would wait on it)."""
        abort = self.abort_comms
        if abort is None:
            return
        t0 = time.monotonic()
        done = threading.Event()
        outcome: list[object] = []

        def run() -> None:
            try:
                outcome.append(abort(generation))
            except BaseException as exc:  # noqa: BLE001 - reported below, then recovery
                outcome.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="hpct-comm-abort").start()
        if not done.wait(self.abort_timeout_s):
            reason = (f"aborting generation {generation}'s communicators did not finish "
                      f"within {self.abort_timeout_s:g} s")
            self.events.emit(Ev.RANK_ABORT_HUNG, generation=generation, error=reason)
            self.on_abort_hung(reason)
            return
        result = outcome[0] if outcome else None
        if isinstance(result, BaseException):
            # The main thread's wait then ends at NCCL's own timeout, as before: worth a record
            self.events.emit(Ev.RANK_ABORT_FAILED, generation=generation,
                             error=f"{type(result).__name__}: {result}")
        elif result:
            self.events.emit(Ev.RANK_ABORTED, generation=generation,
                             seconds=round(time.monotonic() - t0, 4))

    def _exit_hung(self, reason: str) -> None:
        """A process whose communicators cannot be aborted cannot form another group: it
        leaves (the Goodbye tells the controller why) and is replaced as a lost node."""
        self.close(reason)
        os._exit(3)  # the stuck native thread would hold up a normal interpreter exit

    def step_done(self, step: int, shards: int = 1) -> None:
        self.step = step
        now = time.monotonic()
        self.own.step_ends(self.generation, now, shards)
        if should_report(step, self.generation, self._last_report, now, self.step_report_s):
            self._last_report = (self.generation, now)
            self._send_or_close(P.StepDone(self.rank, self.generation, step))

    def next_assignment(self, timeout: float | None = None) -> "P.Assign | P.Goodbye":
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.assignments.get(timeout=0.5)
            except queue.Empty:
                if self.closed.is_set() and self.assignments.empty():
                    return P.Goodbye("controller connection lost")
                if deadline is not None and time.monotonic() > deadline:
                    raise HpctError(f"no assignment from the controller within {timeout:.0f} s")

    def say_goodbye(self, reason: str, answer_within_s: float) -> None:
        """Goodbye with `reason`, then wait up to `answer_within_s` for the controller's own
        Goodbye (it has read ours and decided), then close."""
        self._send_or_close(P.Goodbye(reason))
        deadline = time.monotonic() + answer_within_s
        while not self._bye_received and not self.closed.is_set() \
                and time.monotonic() < deadline:
            try:
                self.assignments.get(timeout=0.05)
            except queue.Empty:
                pass
        self.close(reason)

    def close(self, reason: str = "done") -> None:
        self._closing = True  # before the Goodbye: the controller may hang up as it reads it
        if not self.closed.is_set():
            try:
                self.send(P.Goodbye(reason))
            except (HpctError, OSError):
                pass
        self.closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _read_loop(self) -> None:
        try:
            while True:
                env = self._chan.recv(self._sock)
                msg = env.msg
                if isinstance(msg, P.Stop):
                    if msg.generation >= self.generation:
                        self.stop_reason = msg.reason
                        self.stop_generation = msg.generation
                        self.stop_doomed = bool(msg.lost_addrs) or msg.fault
                        self.stop_event.set()
                        # A rank may wait on a live peer that has already left for recovery
                        # (its own error, or a sub-group's collective), which no cut to the
                        # lost nodes would end: a fault cuts the whole group.
                        whole = msg.fault or self.cut_group_on_any_stop
                        self._sever(sorted(set(msg.lost_addrs) |
                                           (self.group_addrs if whole else set())), whole)
                        if self.stop_doomed:
                            self._abort(msg.generation)
                        interrupt = self.on_stop
                        if interrupt is not None:
                            interrupt()
                elif isinstance(msg, (P.Assign, P.Goodbye)):
                    self._bye_received |= isinstance(msg, P.Goodbye)
                    self.assignments.put(msg)
                elif isinstance(msg, P.Ack):
                    continue
                else:
                    self.events.emit(Ev.RANK_UNEXPECTED_MESSAGE, type=msg.TYPE)
        except P.ConnectionClosed:
            pass
        except (HpctError, OSError) as exc:
            if not self.closed.is_set():
                self.events.emit(Ev.RANK_CONTROLLER_LOST, error=str(exc))
        finally:
            # not `closed`: a failed heartbeat's send sets it too, as the connection dies
            lost = not self._closing and not self._bye_received
            self.closed.set()
            if lost and self.on_lost is not None:
                self.on_lost()

    def _beat_loop(self) -> None:
        while not self.closed.wait(self.heartbeat_s):
            self.heartbeat_now()
