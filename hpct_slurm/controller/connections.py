"""The controller's connections: every rank's (or its node relay's) TCP connection, from the
accept to the last message.

`Conn` is one rank as the controller knows it, `Link` one node relay's connection (all of a
node's local ranks behind it). `Connections` accepts a connection, authenticates it
(protocol.server_hello_async: the job's secret), admits it up to a cap of unregistered ones,
registers the rank (or the relay and then its ranks), reads its messages until it ends, and
hands what they say to the rest of the controller. The checks of what a registered rank may
say are plain functions here (`check_register`, `check_relay_hello`, `refusal`), tested
without a socket (tests/test_controller_rooms.py).
"""
from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from .. import events
from .. import protocol as P
from ..errors import HpctError, describe
from ..events import Ev, EventLog, RankState, Role
from ..protocol.pacing import set_keepalive
from .options import Options
from .pacing import Pacing
from .policy import Held, World

# What a rank may say in a heartbeat (recovery/job.py sets them); anything else is refused.
HEARTBEAT_STATES = events.HEARTBEAT_STATES
# A rank's transfer address: an IPv4/IPv6 address or a host name, nothing else.
HOST_ADDR_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}")
# Connections that have not registered yet. At the cap the oldest is dropped for a newcomer,
# so strangers holding connections open cannot lock the job's ranks out.
MAX_UNREGISTERED = 256
REGISTER_TIMEOUT_S = 30.0
# refusal()'s answer for a message of an older generation: dropped without an event
STALE = ("", "")


@dataclass
class Conn:
    node: str
    local_rank: int
    role: str
    pid: int
    host_addr: str
    transfer_port: int
    writer: asyncio.StreamWriter
    chan: P.Channel
    rank: int = -1
    generation: int = -1
    state: RankState = RankState.REGISTERED
    step: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    progress_at: float = field(default_factory=time.monotonic)  # last time `step` advanced
    reported_at: float | None = None  # when it reported a fault of its own (IN_PROCESS)
    gone: bool = False
    # Generation and step of its last StepDone: within a generation steps only go forward.
    done_generation: int = -1
    done_step: int = -1
    # Its last Holdings report (what it can restore from), cleared at every assignment.
    held: Held | None = None
    held_rank: int = -1
    mode: str = "jit"
    rank_state: bool = False
    shard_keys: list[int] = field(default_factory=list)
    error: str = ""
    # Its heartbeat's own time per step (recovery/own_time.py): the median over `own_n` steps
    # of its generation, for fail-slow detection (slowness.py)
    own_s: float = -1.0
    own_n: int = 0
    # The node relay this rank's messages travel through (None: its own connection, whose
    # writer and chan are above; relayed, they are the relay's).
    link: "Link | None" = None


class Link:
    """A node relay's connection (relay/node.py): every local rank of `node` behind one
    authenticated connection. What the controller sends to those ranks during one pass of
    the event loop (a STOP to every survivor, a generation's Assigns) leaves as one Batch
    frame per node, written at the loop's next turn."""

    def __init__(self, node: str, writer: asyncio.StreamWriter, chan: P.Channel):
        self.node, self.writer, self.chan = node, writer, chan
        self.conns: dict[int, Conn] = {}  # local rank -> its Conn
        self.outbox: list[tuple[int, Any]] = []

    def send(self, local_rank: int, msg) -> None:
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self.flush)
        self.outbox.append((local_rank, msg))

    def flush(self) -> None:
        pairs, self.outbox = self.outbox, []
        if self.writer.is_closing():
            return
        try:
            self.writer.write(b"".join(self.chan.encode_batch(pairs)))
        except (HpctError, OSError, ConnectionError):
            self.writer.close()  # the link ends: its _serve loses the node's ranks


# ---- what a rank may say (pure) -----------------------------------------------------------
def check_register(r: P.Register, job: str, tasks_per_node: int, members: list[str]) -> None:
    """Every field of a Register against what this controller knows (the job, its tasks per
    node, its active members); the error names the field (authentic frames come from the job's
    own processes, so this catches bugs and mixed-up launches rather than strangers)."""
    tpn = tasks_per_node
    if r.job_id != job:
        raise P.ProtocolError(f"register.job_id {r.job_id!r:.40} is not this job ({job})")
    if not 0 <= r.local_rank < tpn:
        raise P.ProtocolError(f"register.local_rank {r.local_rank} is outside 0..{tpn - 1} "
                              f"({tpn} tasks per node)")
    if r.pid <= 0:
        raise P.ProtocolError(f"register.pid {r.pid} is not a process id")
    if not 0 < r.transfer_port < 65536:
        raise P.ProtocolError(f"register.transfer_port {r.transfer_port} is not a TCP port")
    if not HOST_ADDR_RE.fullmatch(r.host_addr):
        raise P.ProtocolError(f"register.host_addr {r.host_addr!r:.80} is not an address")
    if r.role == Role.ACTIVE and r.node not in members:
        raise P.ProtocolError(f"register.role 'active' from {r.node}, which is not an "
                              f"active member ({', '.join(members)})")


def check_relay_hello(hello: P.RelayHello, job: str) -> None:
    """A node relay's first message against this job (whether its node is the job's is
    decided where spares join: spares.py)."""
    if hello.job_id != job:
        raise P.ProtocolError(f"relay_hello.job_id {hello.job_id!r:.40} is not this job "
                              f"({job})")
    if hello.pid <= 0:
        raise P.ProtocolError(f"relay_hello.pid {hello.pid} is not a process id")


def refusal(conn: Conn, msg) -> tuple[str, str] | None:
    """Whether a heartbeat or StepDone from the registered rank `conn` contradicts what the
    controller knows of that rank: None (it counts), (field, why) (refused: an event names the
    field), or STALE (another message of an older generation: dropped quietly). Other
    messages are not checked here."""
    if isinstance(msg, P.Heartbeat):
        if msg.state not in HEARTBEAT_STATES:
            return "state", f"{msg.state!r:.40} is not one of {sorted(HEARTBEAT_STATES)}"
        if msg.step < -1:
            return "step", f"{msg.step} is below -1"
        if not (math.isfinite(msg.own_s) and (msg.own_s >= 0 or msg.own_s == -1.0)):
            return "own_s", f"{msg.own_s!r:.40} is not a number of seconds (or -1)"
        if msg.own_n < 0:
            return "own_n", f"{msg.own_n} is below 0"
        return _not_current(conn, msg)
    if isinstance(msg, P.StepDone):
        if conn.rank < 0:
            return "generation", "before any assignment"
        stale_or_wrong = _not_current(conn, msg)
        if stale_or_wrong is not None:
            return stale_or_wrong
        if msg.step < 0 or (conn.done_generation == msg.generation
                            and msg.step <= conn.done_step):
            return "step", (f"{msg.step} does not follow step {conn.done_step} of generation "
                            f"{msg.generation}")
    return None


def _not_current(conn: Conn, msg) -> tuple[str, str] | None:
    """Whether a heartbeat or StepDone is for the rank and generation `conn` was assigned (None).
    An older generation is stale and dropped quietly (a rank still finishing its last one);
    a newer one, or another rank's number, is refused."""
    if msg.generation < -1 or msg.generation > conn.generation:
        return "generation", (f"{msg.generation} was never assigned to this rank (its "
                              f"generation: {conn.generation})")
    if msg.generation < conn.generation:
        return STALE
    if msg.rank != conn.rank:
        return "rank", f"{msg.rank} is not this connection's rank ({conn.rank})"
    return None


def _broken(exc: BaseException) -> bool:
    """Whether reading a connection failed because the connection broke (reset by the peer,
    timed out by the kernel, or closed half-way through a frame: its process was killed), not
    because of what came over it. The protocol's reader reports a break inside a frame as a
    ProtocolError raised while handling the socket's error, which is then its context."""
    broken = (OSError, asyncio.IncompleteReadError)
    return isinstance(exc, broken) or (isinstance(exc, P.ProtocolError)
                                       and isinstance(exc.__context__, broken))


class Connections:
    """The controller's connection handling (a piece of Controller, controller.py)."""

    # The controller's state this piece reads and writes (Controller.__init__ sets it up).
    o: Options
    job: str
    secret: bytes
    events: EventLog
    world: World
    pacing: Pacing
    job_ranks: int
    conns: dict[tuple[str, int], Conn]
    unregistered: dict[asyncio.StreamWriter, None]  # oldest first
    heard_from: set[str]
    finished: asyncio.Event
    fault_event: asyncio.Event
    recovering: bool
    goodbye_reason: str | None  # set by ending.py once every rank was told goodbye
    script_error: str | None  # a rank's report of an error the script would make anywhere
    # What it passes on to the other pieces: _join_node (spares.py: a pool spare joins),
    # _fault (detection.py), _maybe_start and _track_first_step (recovery_round.py),
    # _maybe_finish and _escalate (ending.py).

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        # Set only once the Register is accepted: a rejected connection (a stranger, a replay,
        # a duplicate) must never touch the state of the rank it claimed to be.
        conn: Conn | None = None
        link: Link | None = None  # or, a node relay's connection: its ranks' messages
        self._admit(writer)
        if self.pacing.keepalive:  # large worlds: a dead node is found by the kernel (pacing.py)
            set_keepalive(writer.get_extra_info("socket"))
        try:
            chan = await P.server_hello_async(writer, self.secret, self.job)
            env = await asyncio.wait_for(chan.read(reader), timeout=REGISTER_TIMEOUT_S)
            if isinstance(env.msg, P.RelayHello):
                link = self._open_link(env.msg, writer, chan)
                while True:
                    env = await chan.read(reader)
                    self._on_batch(link, env.msg)
            if not isinstance(env.msg, P.Register):
                raise P.ProtocolError(f"first message must be register (or a node relay's "
                                      f"relay_hello), got {env.msg.TYPE}")
            conn = self._register(env.msg, writer, chan)
            while True:
                env = await chan.read(reader)
                self._on_message(conn, env.msg)
        except P.ConnectionClosed:
            pass
        except (HpctError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            node = conn.node if conn else link.node if link else None
            if node is not None and _broken(exc):
                # a registered rank's (or relay's) process or node died under it: a loss, with
                # its cause, not something a stranger sent
                self.events.emit(Ev.CONNECTION_LOST, node=node, peer=str(peer),
                                 local_rank=conn.local_rank if conn else None,
                                 error=describe(exc))
            else:
                # Unauthenticated or malformed input never gets further than this line.
                self.events.emit(Ev.PROTOCOL_REJECTED, peer=str(peer), error=describe(exc),
                                 node=node)
        finally:
            self.unregistered.pop(writer, None)
            writer.close()
            for c in [conn] if conn is not None else \
                    list(link.conns.values()) if link is not None else []:
                self._lost(c)

    def _lost(self, conn: Conn) -> None:
        """A rank's connection ended (its own, its relay's, or the relay said it `left`)."""
        if conn.gone:
            return
        conn.gone = True
        if conn.state != RankState.DONE and not self.finished.is_set():
            self._fault(conn.node, "connection lost")

    def _register(self, r: P.Register, writer: asyncio.StreamWriter, chan: P.Channel,
                  link: Link | None = None) -> Conn:
        check_register(r, self.job, self.o.tasks_per_node, self.world.members)
        old = self.conns.get((r.node, r.local_rank))
        if old and not old.gone:
            raise P.ProtocolError(f"{r.node}/{r.local_rank} is already registered")
        self._join_node(r.node, r.role)
        conn = Conn(r.node, r.local_rank, r.role, r.pid, r.host_addr, r.transfer_port,
                    writer, chan, link=link)
        self.unregistered.pop(writer, None)
        self.conns[(r.node, r.local_rank)] = conn
        self.heard_from.add(r.node)
        # transfer: the "host:port" that transfer.* events name as a source
        self.events.emit(Ev.RANK_REGISTER, node=r.node, local_rank=r.local_rank,
                         role=r.role, pid=r.pid,
                         transfer=f"{r.host_addr}:{r.transfer_port}")
        if self.goodbye_reason is not None:  # the job ended: a late spare leaves at once
            asyncio.get_running_loop().create_task(
                self._send(conn, P.Goodbye(self.goodbye_reason)))
            return conn
        self._maybe_start()
        return conn

    def _open_link(self, hello: P.RelayHello, writer: asyncio.StreamWriter,
                   chan: P.Channel) -> Link:
        check_relay_hello(hello, self.job)
        self._join_node(hello.node, hello.role)
        self.unregistered.pop(writer, None)
        self.events.emit(Ev.RELAY_REGISTER, node=hello.node, role=hello.role, pid=hello.pid)
        return Link(hello.node, writer, chan)

    def _on_batch(self, link: Link, msg) -> None:
        """One frame of a node relay: each item as if it came on that rank's own connection.
        An item that contradicts what the controller knows is dropped and logged; the relay
        is authentic, and its other ranks' items still count."""
        if not isinstance(msg, P.Batch):
            raise P.ProtocolError(f"a node relay sends batches, got {msg.TYPE}")
        for lr, m in msg.messages():
            try:
                if isinstance(m, P.Register):
                    if (m.node, m.local_rank) != (link.node, lr):
                        raise P.ProtocolError(f"register of {m.node}/{m.local_rank} on the "
                                              f"relay of {link.node}, item {lr}")
                    link.conns[lr] = self._register(m, link.writer, link.chan, link)
                    continue
                conn = link.conns.get(lr)
                if conn is None:
                    raise P.ProtocolError(f"{m.TYPE} from {link.node}/{lr}, which is not "
                                          f"registered on its relay")
                if conn.gone:
                    continue  # fenced or left: what it said after that no longer counts
                if isinstance(m, P.Left):
                    self._lost(conn)
                else:
                    self._on_message(conn, m)
            except P.ProtocolError as exc:
                self.events.emit(Ev.PROTOCOL_REJECTED, node=link.node, local_rank=lr,
                                 error=describe(exc))

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        """Count a new connection as unregistered, dropping the oldest such one at the cap."""
        if len(self.unregistered) >= max(MAX_UNREGISTERED, self.job_ranks):
            oldest = next(iter(self.unregistered))
            del self.unregistered[oldest]
            oldest.transport.abort()  # its _serve sees the connection fail and logs it
        self.unregistered[writer] = None

    def _refuse(self, conn: Conn, msg, name: str, why: str) -> None:
        """Drop a message from a registered rank whose field `name` contradicts what the
        controller knows of that rank; the connection stays (the rank is authentic)."""
        self.events.emit(Ev.PROTOCOL_REJECTED, node=conn.node, local_rank=conn.local_rank,
                         type=msg.TYPE, field=name, error=f"{msg.TYPE}.{name} {why}")

    def _on_message(self, conn: Conn, msg) -> None:
        conn.last_seen = time.monotonic()
        refused = refusal(conn, msg)
        if refused is not None:
            if refused != STALE:
                self._refuse(conn, msg, *refused)
            return
        if isinstance(msg, P.Heartbeat):
            previous = conn.state
            conn.state, conn.step = RankState(msg.state), msg.step
            conn.own_s, conn.own_n = msg.own_s, msg.own_n
            if conn.state == RankState.DONE:
                self._maybe_finish(conn)
            elif conn.state in (RankState.READY, RankState.UNHEALTHY):
                if not self.recovering and previous not in (RankState.READY, RankState.UNHEALTHY) \
                        and conn.rank >= 0 and conn.generation == self.world.generation \
                        and conn.node in self.world.members:
                    # nobody told it to stop: the rank failed on its own
                    if conn.state == RankState.UNHEALTHY:
                        self._fault(conn.node, "rank failed its health check")
                    else:
                        conn.reported_at = time.monotonic()
                self.fault_event.set()
        elif isinstance(msg, P.StepDone):
            conn.done_generation, conn.done_step = msg.generation, msg.step
            if msg.step > conn.step:
                conn.progress_at = time.monotonic()
            conn.step = msg.step
            conn.state = RankState.RUNNING
            self._track_first_step(msg.step)
        elif isinstance(msg, P.Holdings):
            if msg.generation == conn.generation and msg.rank == conn.rank:
                conn.held = Held(frozenset(msg.own), frozenset(msg.rank_own),
                                 {r: frozenset(v) for r, v in msg.replicas.items()})
                conn.held_rank, conn.mode, conn.rank_state = msg.rank, msg.mode, msg.rank_state
                conn.shard_keys = list(msg.shard_keys)
                conn.error = msg.error
        elif isinstance(msg, P.Goodbye):
            conn.state = RankState.DONE if msg.reason == "done" else conn.state
            if msg.reason.startswith(P.SCRIPT_ERROR) and self.script_error is None \
                    and not self.finished.is_set():
                # Set before the rank's connection and step end (read next): those are the
                # script's error leaving, not a node to fence and replace.
                self.script_error = msg.reason[len(P.SCRIPT_ERROR):]
                asyncio.ensure_future(self._escalate(
                    f"rank {conn.rank} on {conn.node} raised: {self.script_error}",
                    script=True))
        else:
            self.events.emit(Ev.PROTOCOL_UNEXPECTED, node=conn.node, type=msg.TYPE)

    async def _send(self, conn: Conn, msg) -> None:
        if conn.gone:
            return
        if conn.link is not None:
            conn.link.send(conn.local_rank, msg)
            return
        try:
            await conn.chan.write(conn.writer, msg)
        except (HpctError, OSError, ConnectionError):
            conn.gone = True

    def _live(self, node: str) -> list[Conn]:
        # by key, not a scan: called per node on every registration and round (O(world) each)
        return [c for lr in range(self.o.tasks_per_node)
                if (c := self.conns.get((node, lr))) is not None and not c.gone]

    def _node_ready(self, node: str) -> bool:
        return len(self._live(node)) == self.o.tasks_per_node
