"""The controller on the batch host: steps, heartbeats, detection, relaunch onto a spare.

One asyncio loop owns all state. Ranks connect over TCP (hpct_slurm.protocol, per-job secret); every
active node runs its own `srun -N1 -w node` step (a node's failure then ends only its own step),
every spare node a warm-spare step. A fault — a dropped connection, missed heartbeats, a step
that exits, srun's "Node failure on" line — starts one recovery round: STOP to the survivors,
fence the lost node (DOWN in Slurm, or cancel a hung step), wait for survivors to report ready,
give the lost positions to warm spares under a new generation, and track the first completed
step. Faults that arrive during a round are folded into the next round.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from .. import config as C
from .. import protocol as P
from ..errors import HpctError, describe
from .. import events
from ..events import Ev, EventLog, RankState, Role
from ..rundir import private_dir, write_private
from ..slurm.client import SlurmClient, SlurmCommandError, srun_argv
from .lifecycle import Lifecycle
from .pacing import AssignView, compact_members, pace, relayed, set_keepalive
from .policy import (Held, RecoveryDecision, RecoveryRecord, SurvivorReport, World,
                     data_ranks, decide_recovery, initial_shards)

NODE_FAILURE_RE = re.compile(r"Node failure on (\S+)")
RANK_DIR_RE = re.compile(r"rank[0-9]{1,9}")  # ASCII digits: '²'.isdigit() but int('²') fails
# The last line of a Python traceback (`FileNotFoundError: ...`), or an hpct error line.
ERROR_LINE_RE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt)\b|^HPCT: ")
# A rank that caught a failure itself (an exception in its step, a failed restore) and is ready
# for the next generation, while nothing else is known to be lost: its process is healthy, so it
# restarts in place with everyone else instead of being replaced.
IN_PROCESS = "rank reported a fault"
# How long a rank's own report waits for a harder cause (a peer's lost connection usually
# arrives within milliseconds of the collective error that made the rank report).
IN_PROCESS_GRACE_S = 0.5
# How long an escalation before the first step waits for more nodes failing the same way.
START_FAILURE_GRACE_S = 3.0
# The controller's exit codes, which are the job's (the batch script execs it), so that
# Slurm's requeue logic (slurm.conf RequeueExit) hears the truth:
EXIT_OK = 0
EXIT_FAILED = 1        # the script's own error, or a refusal: the same run would fail again
EXIT_RETRY = 75        # EX_TEMPFAIL: the infrastructure failed beyond what the spares absorb
                       # and the job was requeued; a run on other nodes can succeed
EXIT_TERMINATED = 143  # SIGTERM (a time limit, scancel): the persister finished first
# What a rank may say in a heartbeat (recovery/job.py sets them); anything else is refused.
HEARTBEAT_STATES = events.HEARTBEAT_STATES
# A rank's transfer address: an IPv4/IPv6 address or a host name, nothing else.
HOST_ADDR_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}")
# Connections that have not registered yet. At the cap the oldest is dropped for a newcomer,
# so strangers holding connections open cannot lock the job's ranks out.
MAX_UNREGISTERED = 256
REGISTER_TIMEOUT_S = 30.0


class ScriptError(HpctError):
    """The training script itself fails (the same way wherever it runs): not requeued."""


@dataclass
class Options:
    command: list[str]
    run_dir: Path
    job_id: int
    nodes: list[str]
    batch_host: str
    spares: int = 1
    active: int | None = None
    persist_every: int = 10
    tasks_per_node: int = 1
    heartbeat_timeout_s: float = 3.0
    ready_timeout_s: float = 60.0
    store: str = "rootless"
    collective_timeout_s: float = 10.0
    # bounded so a member lost between assignment and formation costs at most this long
    init_timeout_s: float = 30.0
    on_no_spare: str = "requeue"  # or "fail"
    pool_spares: int = 0  # spares the job may borrow from the cluster pool over its life
    pool_reservation: str = "hpct_spares"
    slurmd_port: int = 6818
    # A running rank whose step does not advance for this long is hung (a deadlocked training
    # thread keeps heartbeating from its background thread): it is fenced and replaced.
    progress_timeout_s: float = 300.0
    # In-process restarts that make no progress (the same restore step every time) before the
    # job escalates (requeue from disk, or fail).
    max_stalled_restarts: int = 3
    # Slurm's own view of the job's nodes, polled this often (sinfo --json, off the loop).
    node_poll_s: float = 5.0
    # Warm spares the user asked for (with --active, the allocation decides how many it gets)
    # and what to do with fewer on a first start: "warn" (an event and a status line) or
    # "refuse" (end the job). A requeued job only warns: it lost the node it is short of.
    want_spares: int | None = None
    on_few_spares: str = "warn"
    restart_count: int = 0


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


async def spawn_srun(node: str, role: str, argv: list[str], env: dict[str, str],
                     log) -> asyncio.subprocess.Process:
    """Start one node's job step: `argv` (an `srun -N1 -w node ...` line) as a subprocess,
    stdout into the node's log file `log`, stderr piped (the controller reads srun's "Node
    failure on" line and the script's last error from it). The controller's default step
    launcher; see Controller's `spawn_step`."""
    return await asyncio.create_subprocess_exec(
        *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log,
        stderr=asyncio.subprocess.PIPE)


# (node, role, argv, env, log) -> a started step: what spawn_srun returns, or a stand-in with
# `pid`, `stderr` (an async iterable of byte lines), `wait()` (a coroutine: the exit code) and
# `kill()`.
StepSpawner = Callable[[str, str, list[str], dict[str, str], Any], Awaitable[Any]]


class Controller:
    def __init__(self, opts: Options, client: SlurmClient | None = None,
                 spawn_step: StepSpawner | None = None):
        """`client`: the door to Slurm (a SlurmClient; tests give one with a stand-in runner).
        `spawn_step`: how a node's step is started, spawn_srun (a real srun subprocess) unless
        given; tests pass a stand-in that starts in-process fake ranks instead, so that the
        state machine runs without a cluster (tests/test_controller_fast.py)."""
        self.o = opts
        self.slurm = client or SlurmClient()
        self.spawn_step: StepSpawner = spawn_step or spawn_srun
        self.run_dir = opts.run_dir
        # Whoever can write into the run dir can run code as this user (companion.sbatch) and
        # hand the job a training state (persisted snapshots): 0700, or refused (rundir.py).
        for d in (self.run_dir, self.run_dir / "logs", self.run_dir / "events"):
            private_dir(d)
        self.events = EventLog(self.run_dir / "controller.jsonl", source="controller")
        secret_path = self.run_dir / "secret"
        self.secret = (P.load_secret(secret_path) if secret_path.exists()
                       else P.new_secret_file(secret_path))
        self.secret_path = secret_path
        self.job = str(opts.job_id)
        from .policy import split_allocation

        active, spares = split_allocation(opts.nodes, opts.batch_host, opts.spares,
                                          opts.active)
        self.world = World(active, spares, opts.tasks_per_node)
        # heartbeat and step-report intervals that keep the message rate bounded (pacing.py)
        self.pacing = pace((len(active) + len(spares)) * opts.tasks_per_node,
                           opts.heartbeat_timeout_s)
        # a node's ranks behind one relay (relay/node.py): a round costs O(nodes) frames
        self.relayed = relayed(opts.tasks_per_node)
        # A burst of the job's own connections may sit unregistered at once (bench scale: a
        # 256 cap aborted ranks whose Register was already buffered); strangers still need
        # as many connections as the job has ranks to crowd it out.
        self.job_ranks = (len(active) + len(spares)) * opts.tasks_per_node
        self.shards = initial_shards(active)
        self.data_world = self.world.world_size  # the global batch never changes
        self.conns: dict[tuple[str, int], Conn] = {}
        self.unregistered: dict[asyncio.StreamWriter, None] = {}  # oldest first
        self.steps: dict[str, asyncio.subprocess.Process] = {}
        self.dead_nodes: set[str] = set()
        self.expected_exits: set[int] = set()  # pids of steps we cancelled ourselves
        self.borrowed: list[int] = []  # companion jobs submitted into the spare pool
        self.pool_nodes: set[str] = set()
        self.pending_faults: dict[str, str] = {}
        self.stalled_restarts = 0
        self.trained = False  # some rank completed a step: failures since are not start-up's
        self.start_failures: dict[str, str] = {}  # node -> its step's error, before any step
        self.last_error: dict[str, str] = {}  # node -> the last error line its step printed
        self.fault_event = asyncio.Event()
        self.recovering = False
        self.recovery: RecoveryRecord | None = None  # the round whose first step is awaited
        self.first_step_reports: dict[int, int] = {}  # generation -> its first step's reports
        self.finished = asyncio.Event()
        self.done_sent = False
        # this generation's connections that said done (ids): _maybe_finish looks at every
        # rank only once they are as many as the world (each done heartbeat checking every
        # rank is O(world^2) at a job's end)
        self.said_done: set[int] = set()
        self.gen0_scheduled = False  # generation 0's assignment is on its way (once)
        self.exit_code = EXIT_OK
        self.address: tuple[str, int] = ("", 0)
        # A requeued job (or one restarted by hand on the same run dir) starts from the last
        # intact persisted snapshot instead of step 0.
        self.initial_restore = self._persisted_step()
        self.lifecycle = Lifecycle(self)  # planned moves, growing back, the Slurm record
        if opts.store == "tcpstore":
            # Stock TCPStore has no authentication: say so where the admin and the user look.
            warning = ("the tcpstore rendezvous is not authenticated: any host that reaches "
                       "MASTER_PORT can read and overwrite its keys; use --store rootless on a "
                       "shared network (docs/admin.md)")
            self.events.emit(Ev.CONTROLLER_STORE_UNAUTHENTICATED, store="tcpstore",
                             warning=warning)
            print(f"hpct-slurm: warning: {warning}", file=sys.stderr)

    # ---- lifecycle -----------------------------------------------------------------------
    async def run(self) -> int:
        host = _resolve(self.o.batch_host)
        server = await asyncio.start_server(self._serve, host, 0, backlog=1024)
        # `--signal=B:TERM@N` (or scancel -b -s TERM) reaches the batch shell, which execs us:
        # say goodbye to every rank (each closes its persister) and end with 143.
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGTERM, lambda: asyncio.ensure_future(self._terminate("SIGTERM")))
        self.address = server.sockets[0].getsockname()[:2]
        self.events.emit(Ev.CONTROLLER_START, job_id=self.o.job_id, active=self.world.members,
                         spares=self.world.spares, tasks_per_node=self.o.tasks_per_node,
                         store=self.o.store,
                         address=f"{self.address[0]}:{self.address[1]}",
                         command=self.o.command)
        if self._spares_short():
            self.exit_code = EXIT_FAILED
            self.events.emit(Ev.CONTROLLER_EXIT, code=self.exit_code)
            server.close()
            return self.exit_code
        for node in self.world.members:
            self._launch(node, Role.ACTIVE)
        for node in self.world.spares:
            self._launch(node, Role.SPARE)
        self._maybe_borrow()
        tasks = [asyncio.create_task(self._watchdog()), asyncio.create_task(self._faults()),
                 asyncio.create_task(self._poll_slurm())]
        try:
            await self.finished.wait()
        finally:
            for t in tasks:
                t.cancel()
            server.close()
            await self._stop_steps()
            await self._release_borrowed()
        self.events.emit(Ev.CONTROLLER_EXIT, code=self.exit_code)
        return self.exit_code

    def _spares_short(self) -> bool:
        """Say it loudly when the allocation gave fewer warm spares than asked for; True when
        the job must not start (--on-few-spares refuse, first start)."""
        want, got = self.o.want_spares, len(self.world.spares)
        if want is None or got >= want:
            return False
        refuse = self.o.on_few_spares == "refuse" and self.o.restart_count == 0
        self.events.emit(Ev.CONTROLLER_SPARES_SHORT, wanted=want, got=got,
                         action="refuse" if refuse else "warn",
                         nodes=len(self.o.nodes), restart_count=self.o.restart_count)
        if refuse:
            self.events.emit(Ev.JOB_FAILED, cause="config",
                             reason=f"asked for {want} warm spare(s), the allocation gave {got}")
        return refuse

    def _persisted_step(self) -> int:
        """The newest step on disk that every shard key's shared state (one key for plain
        data parallelism) and every rank's own state (a sampler position) has, intact."""
        from ..recovery.persist import load_latest

        shared, rank_steps = self._persisted_steps()
        if not shared:
            return -1
        common = set.intersection(*shared.values(), *rank_steps.values())
        for step in sorted(common, reverse=True):
            try:
                for k in sorted(shared):
                    got, _, _ = load_latest(self.run_dir / "persist", k, step, key=self.secret)
                    if got != step:
                        raise HpctError(f"shard key {k}'s file of step {step} is damaged")
            except HpctError as exc:
                self.events.emit(Ev.CONTROLLER_PERSISTED_STEP_INCOMPLETE, step=step,
                                 error=exc.message)
                continue
            self.events.emit(Ev.CONTROLLER_RESUME_FROM_DISK, step=step,
                             restart_count=os.environ.get("SLURM_RESTART_COUNT", "0"))
            return step
        return -1

    def _step_env(self, role: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            C.CONTROLLER_ADDR: f"{self.address[0]}:{self.address[1]}",
            C.SECRET_FILE: str(self.secret_path),
            C.RUN_DIR: str(self.run_dir),
            C.ROLE: role,
            C.STORE: self.o.store,
            # the controller is the one writer of the ranks' timeouts (a task prolog leaves
            # them alone: hooks/task_prolog.CONTROLLER_OWNED)
            C.COLLECTIVE_TIMEOUT_S: str(self.o.collective_timeout_s),
            C.INIT_TIMEOUT_S: str(self.o.init_timeout_s),
            C.PERSIST_EVERY: str(self.o.persist_every),
            # the data-parallel world, for a DistributedSampler built before job.run
            C.WORLD_SIZE: str(self.data_world),
        })
        env.update(self.pacing.env())
        if self.relayed:
            env[C.RELAY] = "1"
        return env

    def _launch(self, node: str, role: str) -> None:
        env = self._step_env(role)
        argv = srun_argv(node, self.o.command, ntasks=self.o.tasks_per_node,
                         job_id=self.o.job_id,
                         extra_opts=["--overlap", "--kill-on-bad-exit=0", "-u",
                                     f"--job-name=hpct-{role}-{node}", "--cpus-per-task=1"])
        log = open(self.run_dir / "logs" / f"{node}.out", "ab")
        proc_task = asyncio.create_task(self._run_step(node, role, argv, env, log))
        proc_task.add_done_callback(lambda t: log.close())
        self.events.emit(Ev.STEP_LAUNCH, node=node, role=role)

    async def _run_step(self, node: str, role: str, argv: list[str], env: dict, log) -> None:
        proc = await self.spawn_step(node, role, argv, env, log)
        self.steps[node] = proc
        assert proc.stderr is not None
        async for raw in proc.stderr:
            log.write(raw)
            log.flush()
            line = raw.decode(errors="replace")
            m = NODE_FAILURE_RE.search(line)
            if m:
                self._fault(m.group(1), "srun: node failure")
            elif ERROR_LINE_RE.match(line):
                self.last_error[node] = line.strip()[:500]
        rc = await proc.wait()
        if self.steps.get(node) is proc:
            del self.steps[node]
        self.events.emit(Ev.STEP_EXIT, node=node, role=role, code=rc,
                         error=self.last_error.get(node, "") if rc else "")
        if rc and not self.trained and not self.finished.is_set() \
                and proc.pid not in self.expected_exits:
            self._start_failure(node, rc)
        if not self.finished.is_set() and node not in self.dead_nodes \
                and proc.pid not in self.expected_exits:
            # srun exits 0 even on node failure: any exit while training runs is a fault.
            if node in self.world.members or node in self.world.spares:
                self._fault(node, f"step exited ({rc})")

    def _start_failure(self, node: str, rc: int) -> None:
        """A step that failed before the job completed any step. On one node that may be the
        node (it is replaced like any fault); the same error from two nodes is the script's:
        every replacement would fail the same way and a requeue would run it again, so the
        job ends with that error."""
        error = self.last_error.get(node) or f"exit code {rc}"
        self.start_failures[node] = error
        same = [n for n, e in self.start_failures.items() if e == error]
        if len(same) >= min(2, len(self.world.members) + len(self.world.spares)):
            asyncio.ensure_future(self._escalate(
                f"the training command failed before its first step on {', '.join(same)}: "
                f"{error}", script=True))

    async def _stop_steps(self, grace: float = 15.0) -> None:
        deadline = time.monotonic() + grace
        for proc in list(self.steps.values()):
            with contextlib.suppress(asyncio.TimeoutError, ProcessLookupError):
                await asyncio.wait_for(proc.wait(), max(0.1, deadline - time.monotonic()))
        for proc in list(self.steps.values()):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    # ---- connections ---------------------------------------------------------------------
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
            # Unauthenticated or malformed input never gets further than this line.
            self.events.emit(Ev.PROTOCOL_REJECTED, peer=str(peer), error=describe(exc),
                             node=conn.node if conn else link.node if link else None)
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

    def _join_node(self, node: str, role: str) -> None:
        """Refuse a node that is not the job's, unless it is a spare lent by the pool."""
        if node not in self.world.members and node not in self.world.spares:
            if role != Role.SPARE or not self.borrowed or node in self.dead_nodes:
                raise P.ProtocolError(f"node {node} is not part of this job")
            self.pool_nodes.add(node)
            self.world.spares.append(node)
            self.events.emit(Ev.POOL_SPARE_JOINED, node=node)

    def _register(self, r: P.Register, writer: asyncio.StreamWriter, chan: P.Channel,
                  link: Link | None = None) -> Conn:
        self._check_register(r)
        old = self.conns.get((r.node, r.local_rank))
        if old and not old.gone:
            raise P.ProtocolError(f"{r.node}/{r.local_rank} is already registered")
        self._join_node(r.node, r.role)
        conn = Conn(r.node, r.local_rank, r.role, r.pid, r.host_addr, r.transfer_port,
                    writer, chan, link=link)
        self.unregistered.pop(writer, None)
        self.conns[(r.node, r.local_rank)] = conn
        # transfer: the "host:port" that transfer.* events name as a source
        self.events.emit(Ev.RANK_REGISTER, node=r.node, local_rank=r.local_rank,
                         role=r.role, pid=r.pid,
                         transfer=f"{r.host_addr}:{r.transfer_port}")
        self._maybe_start()
        return conn

    def _open_link(self, hello: P.RelayHello, writer: asyncio.StreamWriter,
                   chan: P.Channel) -> Link:
        if hello.job_id != self.job:
            raise P.ProtocolError(f"relay_hello.job_id {hello.job_id!r:.40} is not this job "
                                  f"({self.job})")
        if hello.pid <= 0:
            raise P.ProtocolError(f"relay_hello.pid {hello.pid} is not a process id")
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

    def _check_register(self, r: P.Register) -> None:
        """Every field of a Register against what this controller knows; the error names the
        field (authentic frames come from the job's own processes, so this catches bugs and
        mixed-up launches rather than strangers)."""
        tpn = self.o.tasks_per_node
        if r.job_id != self.job:
            raise P.ProtocolError(f"register.job_id {r.job_id!r:.40} is not this job ({self.job})")
        if not 0 <= r.local_rank < tpn:
            raise P.ProtocolError(f"register.local_rank {r.local_rank} is outside 0..{tpn - 1} "
                                  f"({tpn} tasks per node)")
        if r.pid <= 0:
            raise P.ProtocolError(f"register.pid {r.pid} is not a process id")
        if not 0 < r.transfer_port < 65536:
            raise P.ProtocolError(f"register.transfer_port {r.transfer_port} is not a TCP port")
        if not HOST_ADDR_RE.fullmatch(r.host_addr):
            raise P.ProtocolError(f"register.host_addr {r.host_addr!r:.80} is not an address")
        if r.role == Role.ACTIVE and r.node not in self.world.members:
            raise P.ProtocolError(f"register.role 'active' from {r.node}, which is not an "
                                  f"active member ({', '.join(self.world.members)})")

    def _refuse(self, conn: Conn, msg, name: str, why: str) -> None:
        """Drop a message from a registered rank whose field `name` contradicts what the
        controller knows of that rank; the connection stays (the rank is authentic)."""
        self.events.emit(Ev.PROTOCOL_REJECTED, node=conn.node, local_rank=conn.local_rank,
                         type=msg.TYPE, field=name, error=f"{msg.TYPE}.{name} {why}")

    def _current(self, conn: Conn, msg) -> bool:
        """Whether a heartbeat or StepDone is for the rank and generation `conn` was assigned.
        An older generation is stale and dropped quietly (a rank still finishing its last
        one); a newer one, or another rank's number, is refused."""
        if msg.generation < -1 or msg.generation > conn.generation:
            self._refuse(conn, msg, "generation", f"{msg.generation} was never assigned to this "
                                                  f"rank (its generation: {conn.generation})")
            return False
        if msg.generation < conn.generation:
            return False
        if msg.rank != conn.rank:
            self._refuse(conn, msg, "rank", f"{msg.rank} is not this connection's rank "
                                            f"({conn.rank})")
            return False
        return True

    def _on_message(self, conn: Conn, msg) -> None:
        conn.last_seen = time.monotonic()
        if isinstance(msg, P.Heartbeat):
            if msg.state not in HEARTBEAT_STATES:
                self._refuse(conn, msg, "state", f"{msg.state!r:.40} is not one of "
                                                 f"{sorted(HEARTBEAT_STATES)}")
                return
            if msg.step < -1:
                self._refuse(conn, msg, "step", f"{msg.step} is below -1")
                return
            if not self._current(conn, msg):
                return
            previous = conn.state
            conn.state, conn.step = RankState(msg.state), msg.step
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
            if conn.rank < 0:
                self._refuse(conn, msg, "generation", "before any assignment")
                return
            if not self._current(conn, msg):
                return
            if msg.step < 0 or (conn.done_generation == msg.generation
                                and msg.step <= conn.done_step):
                self._refuse(conn, msg, "step", f"{msg.step} does not follow step "
                                                f"{conn.done_step} of generation {msg.generation}")
                return
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

    # ---- generation 0 --------------------------------------------------------------------
    def _maybe_start(self) -> None:
        # Once: the ranks get their numbers only when the task runs, so registrations that
        # arrive before it (spares registering with the last member) would each schedule
        # another generation 0, and a rank would find a stale Assign queued at its next fault.
        if self.world.generation == 0 and self.recovery is None and not self.recovering \
                and not self.gen0_scheduled \
                and len(self.conns) >= len(self.world.members) * self.o.tasks_per_node \
                and all(self._node_ready(n) for n in self.world.members) \
                and all(c.rank < 0 for n in self.world.members for c in self._live(n)):
            self.gen0_scheduled = True
            asyncio.create_task(self._assign(restore=self.initial_restore, sources={}))

    async def _assign(self, restore: int, sources: dict[int, list[tuple[str, int]]]) -> None:
        g = self.world.generation
        self.said_done.clear()
        self.events.emit(Ev.GENERATION_START, generation=g, members=self.world.members,
                         restore_step=restore)
        members = [c for node in self.world.members for c in self._live(node)]
        first = self.world.first_ranks()
        for c in members:
            c.rank = first[c.node] + c.local_rank
        peers = {c.rank: (c.host_addr, c.transfer_port) for c in members}
        # beyond pacing.FULL_VIEW_MAX ranks each rank gets only the peers and sources it uses
        # (a sharded job's ranks need every peer's address: they keep the full view)
        sharded = any(c.shard_keys for c in members)
        names, hostlist = compact_members(self.world.members, self.world.world_size)
        view = AssignView(self.world.world_size, len(self.world.members), sources, peers)
        for c in members:
            c.generation, c.state, c.role = g, RankState.ASSIGNED, Role.ACTIVE
            c.progress_at, c.reported_at = time.monotonic(), None
            c.held, c.error = None, ""
            src, prs = (sources, peers) if sharded else view(c.rank)
            await self._send(c, P.Assign(
                g, c.rank, self.world.world_size, names,
                self.o.tasks_per_node, restore, src,
                data_ranks(self.shards[c.node], c.local_rank, self.o.tasks_per_node),
                self.data_world, prs, hostlist))
        if g == 0:
            # The job's connections and their state now live as long as the job: out of the
            # collector's sight, a full collection during a later round scans only what the
            # rounds made (bench scale: ~110 ms per full collection at 8,192 ranks, landing in
            # the rounds). The cost: a cycle among them that becomes garbage later (a lost
            # node's connection objects) is never collected.
            gc.collect()
            gc.freeze()

    # ---- detection -----------------------------------------------------------------------
    def _fault(self, node: str, reason: str) -> None:
        if self.finished.is_set() or node in self.pending_faults or node in self.dead_nodes:
            return
        if node not in self.world.members and node not in self.world.spares:
            return
        self.pending_faults[node] = reason
        self.events.emit(Ev.FAULT_DETECTED, node=node, reason=reason,
                         generation=self.world.generation,
                         role=Role.SPARE if node in self.world.spares else Role.ACTIVE)
        self.fault_event.set()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.pacing.sweep_s)
            now = time.monotonic()
            reported = []
            for c in list(self.conns.values()):
                if c.gone or c.state == RankState.DONE:
                    continue
                if now - c.last_seen > self.pacing.silence_timeout_s:
                    self._fault(c.node, f"no heartbeat for {now - c.last_seen:.1f} s")
                elif c.state == RankState.RUNNING and not self.recovering \
                        and not self.pending_faults \
                        and now - c.progress_at > self.o.progress_timeout_s:
                    # (while a fault is handled nobody progresses: survivors are tearing down)
                    self._fault(c.node, f"no progress for {now - c.progress_at:.0f} s "
                                        f"(stuck after step {c.step})")
                elif c.reported_at is not None and now - c.reported_at > IN_PROCESS_GRACE_S:
                    reported.append(c)
            # The first rank to report is the one that failed; the others' collectives failed
            # because it left (and all of them restart in place anyway).
            if reported and not self.recovering and not self.pending_faults:
                first = min(reported, key=lambda c: c.reported_at or now)
                if first.state == RankState.READY and first.generation == self.world.generation:
                    self._fault(first.node, IN_PROCESS)
            for c in reported:
                c.reported_at = None

    async def _poll_slurm(self) -> None:
        """Slurm's view, throttled: a node it marks DOWN or NOT_RESPONDING (its slurmd silent
        for SlurmdTimeout) is lost, even while our own connections to it still look fine (a
        dead slurmd, a half-open link): its steps can no longer be managed, so move off it."""
        while True:
            await asyncio.sleep(self.o.node_poll_s)
            try:
                nodes = await asyncio.to_thread(self.slurm.nodes)
            except HpctError as exc:
                self.events.emit(Ev.SLURM_ERROR, error=exc.message)
                continue
            for n in nodes:
                if n.lost and (n.name in self.world.members or n.name in self.world.spares):
                    self._fault(n.name, "slurm: node down" if n.state == "DOWN"
                                else "slurm: node not responding")
            self.lifecycle.on_nodes(nodes)  # a drained member moves; a shrunk job grows back

    # ---- recovery ------------------------------------------------------------------------
    async def _faults(self) -> None:
        while True:
            await self.fault_event.wait()
            self.fault_event.clear()
            if self.pending_faults and not self.recovering:
                self.recovering = True
                try:
                    await self._recover()
                except Exception as exc:  # never let the fault loop die: escalate instead
                    why = exc.message if isinstance(exc, HpctError) else \
                        f"{type(exc).__name__}: {exc}"
                    self.events.emit(Ev.RECOVERY_FAILED, error=why)
                    await self._escalate(why, script=isinstance(exc, ScriptError))
                finally:
                    self.recovering = False
                if self.pending_faults:
                    self.fault_event.set()

    async def _recover(self) -> None:
        """One recovery round: detect, stop, fence, survivors ready (the I/O, here), the
        decision (policy.decide_recovery), then the new generation's assignment."""
        rec = RecoveryRecord(t_detect=time.time())
        lost = dict(self.pending_faults)
        self.pending_faults.clear()
        lost_spares = [n for n in lost if n in self.world.spares]
        for node in lost_spares:
            await self._fence(node, lost[node])
            self.world.spares.remove(node)
        # A member whose ranks all reported a fault of their own and are ready stays a member:
        # they restart in place, like every other survivor.
        in_place = [n for n in lost if lost[n] == IN_PROCESS and n in self.world.members
                    and self._node_ready(n)
                    and all(c.state == RankState.READY for c in self._live(n))]
        for node in in_place:
            del lost[node]
        lost_active = [n for n in lost if n in self.world.members]
        if not lost_active and not in_place:
            return
        if in_place:
            self.events.emit(Ev.FAULT_IN_PROCESS, nodes=in_place,
                             generation=self.world.generation)
        g = self.world.generation
        survivors = [c for n in self.world.members if n not in lost for c in self._live(n)]
        lost_addrs = sorted({c.host_addr for (n, _), c in self.conns.items() if n in lost_active})
        stop = P.Stop(g, f"{', '.join(lost_active)}: {'; '.join(lost[n] for n in lost_active)}",
                      lost_addrs)  # the same (immutable) message for every survivor
        for c in survivors:
            await self._send(c, stop)
        rec.t_stop = time.time()
        self.events.emit(Ev.FAULT_STOP_SENT, generation=g, survivors=len(survivors))
        for node in lost_active:
            await self._fence(node, lost[node])
        rec.t_fenced = time.time()
        await self._wait_ready(survivors)
        # a survivor that failed its health check or never answered is lost as well
        for c in survivors:
            if c.gone or c.state != RankState.READY:
                self.pending_faults.setdefault(c.node, f"not ready after fault ({c.state})")
        for node in [n for n in self.pending_faults if n in lost]:
            del self.pending_faults[node]  # the same loss seen twice (e.g. EOF, then step exit)
        if self.pending_faults:
            extra = list(self.pending_faults)
            self.events.emit(Ev.FAULT_SECOND, nodes=extra, during="recovery")
            for node in extra:
                lost[node] = self.pending_faults.pop(node)
                await self._fence(node, lost[node])
                if node in self.world.spares:
                    self.world.spares.remove(node)
            lost_active = [n for n in lost if n in self.world.members]
            survivors = [c for c in survivors if c.node not in lost]
        rec.t_ready = time.time()
        # the newest step any rank of this generation completed: the restore step's distance
        # from it is the steps lost (recomputed)
        rec.newest_done = max((c.done_step for c in self.conns.values()
                               if c.generation == g and c.done_generation == g), default=-1)
        d = await self._decide(lost_active, survivors, lost_spares)
        if d.shrunk:
            assert d.replacement is not None
            self.shards = d.shards
            self.events.emit(Ev.RECOVERY_SHRINK, generation=d.replacement.generation,
                             lost=lost_active, members=d.replacement.members, shards=self.shards)
        if d.plan is not None:
            self.stalled_restarts = d.stalled_restarts
        if d.escalates:
            # _faults reports it (recovery.failed) and escalates: requeue or fail
            raise (ScriptError if d.script else HpctError)(d.reason)
        assert d.replacement is not None and d.plan is not None
        rep, plan = d.replacement, d.plan
        self.shards = d.shards
        self.world.members, self.world.spares = rep.members, d.spares
        self.world.generation = rep.generation
        self.world.lost += lost_active
        restore = plan.step
        # shared state is identical on every survivor: the controller lists all that hold the
        # restore step, nearest first, so a corrupted or vanished source costs one retry, not
        # the recovery (a spare that took a position in a round cut short holds nothing yet:
        # asking it would cost a refused request)
        first = self.world.first_ranks()
        sources = {first[c.node] + c.local_rank: [(c.host_addr, c.transfer_port)]
                   for c in survivors if c.held is not None and restore in c.held.own}
        rec.generation, rec.restore_step = rep.generation, restore
        rec.lost, rec.taken = lost_active, rep.taken
        rec.reasons = {n: lost[n] for n in lost_active}
        rec.t_assigned = time.time()
        self.recovery = rec
        self.events.emit(Ev.RECOVERY_ASSIGN, generation=rep.generation, restore_step=restore,
                         taken=rep.taken, members=rep.members,
                         newest_held=max((c.step for c in survivors), default=-1),
                         sources={str(r): src for r, src in sorted(plan.sources.items())})
        if plan.from_disk:
            # Memory could not serve a consistent state for every rank: say so, with the
            # steps this costs, instead of calling it an in-memory recovery.
            self.events.emit(Ev.RECOVERY_DISK_FALLBACK, generation=rep.generation,
                             restore_step=restore, ranks=plan.from_disk,
                             newest_held=max((c.step for c in survivors), default=-1))
        await self._assign(restore, sources)
        self._maybe_borrow()

    async def _decide(self, lost_active: list[str], survivors: list[Conn],
                      lost_spares: list[str], leaving: tuple[str, ...] = ()
                      ) -> RecoveryDecision:
        """What the round does (policy.decide_recovery), from what the controller knows now:
        the ready spares, the survivors' Holdings reports and the steps on disk. `leaving`:
        lost nodes whose ranks live on and serve their state (a planned move)."""
        reports = [SurvivorReport(c.node, c.local_rank, c.held, c.held_rank, c.mode,
                                  c.rank_state, tuple(c.shard_keys), c.error, not c.gone)
                   for c in survivors if c.held is not None]
        disk_shared, disk_rank = await asyncio.to_thread(self._persisted_steps)
        return decide_recovery(
            self.world, lost_active, [s for s in self.world.spares if self._node_ready(s)],
            self.shards, reports, on_no_spare=self.o.on_no_spare, disk_shared=disk_shared,
            disk_rank=disk_rank,
            previous_restore=self.recovery.restore_step if self.recovery else None,
            stalled_restarts=self.stalled_restarts,
            max_stalled_restarts=self.o.max_stalled_restarts,
            unusable=self.dead_nodes | set(lost_spares), leaving=frozenset(leaving))

    async def _wait_ready(self, survivors: list[Conn]) -> None:
        deadline = time.monotonic() + self.o.ready_timeout_s
        waiting = survivors
        while time.monotonic() < deadline:
            # ready counts once its Holdings report is in (it is sent just before); an answer
            # stays given until the next assignment, so each poll looks only at those still
            # waited for (every survivor every 20 ms made the wait O(world) per poll)
            waiting = [c for c in waiting if not (
                c.gone or c.state == RankState.UNHEALTHY
                or (c.state == RankState.READY and c.held is not None))]
            if not waiting:
                break
            if self.pending_faults:
                await asyncio.sleep(0.05)  # a second fault: keep waiting for the rest
            await asyncio.sleep(0.02)

    def _persisted_steps(self) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        """Steps on disk: shard key -> those of the shared state (key 0 alone for plain data
        parallelism), and rank -> those of its own state."""
        from ..recovery.persist import list_steps

        def by_index(root: Path) -> dict[int, set[int]]:
            return {int(d.name[4:]): set(list_steps(root, int(d.name[4:])))
                    for d in (root.glob("rank*") if root.is_dir() else [])
                    if RANK_DIR_RE.fullmatch(d.name)}

        return by_index(self.run_dir / "persist"), by_index(self.run_dir / "persist-rank")

    async def _fence(self, node: str, reason: str) -> None:
        """Make sure nothing of the lost node can rejoin: a dead or unreachable node goes DOWN
        in Slurm; a live node with a failed or hung process has its step cancelled."""
        for c in self._live(node):
            c.gone = True
            c.writer.close()
        alive = await asyncio.to_thread(self._slurmd_reachable, node)
        usable = alive and await asyncio.to_thread(self._usable_in_slurm, node)
        loop = asyncio.get_running_loop()
        if alive and not usable:
            # an admin (or Slurm) took the node out: its steps are gone, never reuse it
            self.dead_nodes.add(node)
            self.events.emit(Ev.FAULT_FENCED, node=node, how="node unavailable in slurm",
                             reason=reason)
            return
        if alive and not reason.startswith("srun: node failure"):
            if node in self.steps:
                self.expected_exits.add(self.steps[node].pid)
            await loop.run_in_executor(None, self._cancel_steps_on, node)
            self.events.emit(Ev.FAULT_FENCED, node=node, how="step cancelled", reason=reason)
            # the node is healthy: it becomes a warm spare again
            asyncio.get_running_loop().call_later(1.0, self._replenish, node)
            return
        self.dead_nodes.add(node)
        try:
            await loop.run_in_executor(None, lambda: self.slurm.update_node(
                node, "DOWN", f"hpct: {reason} (job {self.o.job_id})"))
        except SlurmCommandError as exc:
            self.events.emit(Ev.SLURM_ERROR, node=node, error=exc.message)
        self.events.emit(Ev.FAULT_FENCED, node=node, how="node down", reason=reason)
        # the admin's policy (leave or reboot), off the recovery's path
        asyncio.ensure_future(self.lifecycle.after_down(node, reason))

    def _replenish(self, node: str) -> None:
        if self.finished.is_set() or node in self.world.spares:
            return
        for key in [k for k, c in self.conns.items() if k[0] == node and c.gone]:
            del self.conns[key]
        self.world.spares.append(node)
        self._launch(node, Role.SPARE)

    def _maybe_borrow(self) -> None:
        """Keep one warm spare from the cluster pool once the allocation's own are used up:
        a companion job in the pool reservation whose processes register as spares here."""
        if self.finished.is_set() or self.world.spares or \
                len(self.borrowed) >= self.o.pool_spares:
            return
        # Written afresh each time: a file already there is never trusted, nor followed.
        script = write_private(self.run_dir / "companion.sbatch",
                               b'#!/bin/bash\n# a warm spare lent by the hpct spare pool\n'
                               b'exec srun -N1 -n"$HPCT_TASKS_PER_NODE" --kill-on-bad-exit=0 '
                               b'-u "$@"\n')
        env = self._step_env("spare")
        env.update({C.JOB_ID: str(self.o.job_id),
                    C.TASKS_PER_NODE: str(self.o.tasks_per_node)})
        options = [f"--reservation={self.o.pool_reservation}", "-N1", "--exclusive",
                   f"--ntasks-per-node={self.o.tasks_per_node}",
                   f"--job-name=hpct-spare-{self.o.job_id}",
                   f"--output={self.run_dir / 'logs' / 'companion-%j.out'}"]
        try:
            job = self.slurm.sbatch(script, options=options, script_args=self.o.command,
                                    env=env)
        except HpctError as exc:
            self.events.emit(Ev.POOL_BORROW_FAILED, error=describe(exc))
            return
        self.borrowed.append(job)
        self.events.emit(Ev.POOL_BORROW, companion_job=job,
                         reservation=self.o.pool_reservation)

    async def _release_borrowed(self) -> None:
        for job in self.borrowed:
            with contextlib.suppress(SlurmCommandError):
                await asyncio.to_thread(self.slurm.cancel, job)

    def _usable_in_slurm(self, node: str) -> bool:
        try:
            info = self.slurm.show_node(node)
        except HpctError:
            return False
        return info.state != "DOWN" and not ({"DRAIN", "NOT_RESPONDING"} & set(info.flags))

    def _slurmd_reachable(self, node: str) -> bool:
        return slurmd_reachable(self.slurm, node, self.o.slurmd_port)

    def _cancel_steps_on(self, node: str) -> None:
        if node in self.pool_nodes:
            for job in self.borrowed:
                with contextlib.suppress(SlurmCommandError):
                    info = self.slurm.show_job(job)
                    if node in info.nodelist:
                        self.slurm.cancel(job, signal="KILL")
            return
        try:
            steps = self.slurm.job_steps(self.o.job_id)
        except HpctError:
            return
        for step in steps:
            # only numbered steps: the batch step ("J.batch") is this controller itself
            if step.nodelist == [node] and step.numbered:
                with contextlib.suppress(SlurmCommandError):
                    self.slurm.cancel(self.o.job_id, int(step.step), signal="KILL")

    def _track_first_step(self, step: int) -> None:
        self.trained = True
        rec = self.recovery
        if not rec or step != rec.first_step:
            return
        # counted first: the full check below is O(world), and run for every rank's report it
        # made a round's end O(world^2) (53 s at 16,384 ranks, bench scale)
        seen = self.first_step_reports.get(rec.generation, 0) + 1
        self.first_step_reports[rec.generation] = seen
        if seen < self.world.world_size:
            return
        ranks = {c.rank for c in self.conns.values() if not c.gone and c.step >= step
                 and c.generation == rec.generation}
        if len(ranks) == self.world.world_size:
            self.recovery = None
            self.lifecycle.round_done(rec, time.time())  # its event, the Slurm comment

    async def _escalate(self, why: str, script: bool = False) -> None:
        """End the job's run here. An infrastructure failure (nodes lost beyond the spares,
        no consistent state in memory) requeues, per --on-no-spare; the script's own error
        never does: it would only fail again."""
        if not script and not self.trained:
            # Before any step, one node's failure may be the first sight of the script's own
            # error on every node (their steps exit within moments of each other): give the
            # others' exits time to arrive, so that _start_failure can call it the script's.
            await asyncio.sleep(START_FAILURE_GRACE_S)
        if self.finished.is_set():
            return
        # Say it in the job's Slurm record too: requeued (the infrastructure) or not (a bug).
        await self.lifecycle.record(
            f"failed, not requeued: the script's own error: {why[:80]}" if script else
            f"requeued: infrastructure: {why[:80]}" if self.o.on_no_spare == "requeue" else
            f"failed: infrastructure: {why[:80]}")
        if script:
            self.events.emit(Ev.JOB_FAILED, cause="script", reason=why)
        elif self.o.on_no_spare == "requeue":
            self.events.emit(Ev.ESCALATE_REQUEUE, cause="infrastructure", reason=why)
            try:
                await asyncio.to_thread(self.slurm.requeue, self.o.job_id)
            except SlurmCommandError as exc:
                self.events.emit(Ev.SLURM_ERROR, error=exc.message)
        else:
            self.events.emit(Ev.ESCALATE_FAIL, cause="infrastructure", reason=why)
        # only a requeued infrastructure failure says "retry": a script's error would fail
        # again, and --on-no-spare fail is the user's choice not to retry
        self.exit_code = (EXIT_RETRY if not script and self.o.on_no_spare == "requeue"
                          else EXIT_FAILED)
        await self._goodbye_all(f"job escalated: {why}")
        self.finished.set()

    # ---- the end -------------------------------------------------------------------------
    async def _terminate(self, why: str) -> None:
        if self.finished.is_set():
            return
        self.events.emit(Ev.CONTROLLER_TERMINATED, signal=why)
        self.exit_code = EXIT_TERMINATED
        await self._goodbye_all(f"terminated: {why}")
        self.finished.set()

    def _maybe_finish(self, conn: Conn) -> None:
        if conn.generation == self.world.generation:
            self.said_done.add(id(conn))
        if self.recovering or len(self.said_done) < self.world.world_size:
            return
        actives = [c for n in self.world.members for c in self._live(n)]
        if len(actives) != self.world.world_size:
            return
        if all(c.state == RankState.DONE for c in actives) and not self.done_sent:
            self.done_sent = True
            self.events.emit(Ev.JOB_DONE, generation=self.world.generation,
                             lost=self.world.lost)
            asyncio.create_task(self._finish())

    async def _finish(self) -> None:
        await self._goodbye_all("done")
        self.finished.set()

    async def _goodbye_all(self, reason: str) -> None:
        for c in list(self.conns.values()):
            await self._send(c, P.Goodbye(reason))


def slurmd_reachable(slurm: SlurmClient, node: str, port: int = 6818) -> bool:
    """Whether the node's slurmd accepts a TCP connection within a second: tells a crashed or
    partitioned node from a live node whose training process failed, long before Slurm's own
    SlurmdTimeout marks it not responding."""
    try:
        addr = slurm.show_node(node).addr or node
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except (OSError, HpctError):
        return False


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise HpctError(f"batch host {host!r} does not resolve: {exc}") from exc


def main_from_env(command: list[str], run_dir: str | None, spares: int, tasks_per_node: int,
                  store: str, heartbeat_timeout_s: float, on_no_spare: str,
                  active: int | None = None, persist_every: int = 10,
                  pool_spares: int = 0, pool_reservation: str = "hpct_spares",
                  progress_timeout_s: float = 300.0, want_spares: int | None = None,
                  on_few_spares: str = "warn") -> int:
    from ..slurm.env import SlurmEnv

    env = SlurmEnv.from_environ()
    if not command:
        raise HpctError("controller needs the training command after --")
    batch_host = env.node_name or socket.gethostname()
    rd = Path(run_dir or C.read(os.environ, C.RUN_DIR) or
              Path(env.submit_dir or os.getcwd()) / f"hpct-{env.job_id}")
    opts = Options(command=command, run_dir=rd, job_id=env.job_id, nodes=env.job_nodelist,
                   batch_host=batch_host, spares=spares, tasks_per_node=tasks_per_node,
                   store=store, heartbeat_timeout_s=heartbeat_timeout_s,
                   on_no_spare=on_no_spare, active=active, persist_every=persist_every,
                   pool_spares=pool_spares, pool_reservation=pool_reservation,
                   progress_timeout_s=progress_timeout_s, want_spares=want_spares,
                   on_few_spares=on_few_spares, restart_count=env.restart_count)
    try:
        return asyncio.run(Controller(opts).run())
    except KeyboardInterrupt:
        print("controller interrupted", file=sys.stderr)
        return 130
