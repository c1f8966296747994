"""The controller on the batch host: steps, heartbeats, detection, relaunch onto a spare.

One asyncio loop owns all state. Ranks connect over TCP (hpct_slurm.protocol, per-job secret); every
active node runs its own `srun -N1 -w node` step (a node's failure then ends only its own step),
every spare node a warm-spare step. A fault — a dropped connection, missed heartbeats, a step
that exits, srun's "Node failure on" line — starts one recovery round: STOP to the survivors,
fence the lost node (DOWN in Slurm, or cancel a hung step), wait for survivors to report ready,
give the lost positions to warm spares under a new generation, and track the first completed
step. Faults that arrive during a round are folded into the next round.

`Controller` here holds the state and starts the loop's tasks; what it does lives in one piece
per concern, each a class in a file of its own that names the state it uses:

* connections.py: accepting, authenticating and reading every rank's (or node relay's)
  connection, and the checks of what a rank may say (`Conn`, `Link`);
* steps.py: the nodes' job steps (srun launch, their exits, stop, cancel);
* detection.py: faults (the watchdog, Slurm's view of the nodes) and `_fault`, their one door;
* recovery_round.py: the recovery round (stop, fence, ready, decide, assign), phase by phase
  over the pure decisions of policy.py, and every generation's assignment;
* fencing.py: making sure nothing of a lost node rejoins (DOWN in Slurm, or its step cancelled);
* spares.py: warm spares (replenish, borrow from the pool, release);
* ending.py: the end of the run (done, SIGTERM, escalation) and the exit codes;
* lifecycle.py: planned moves, growing back and the job's Slurm comment (`Lifecycle`).
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

from .. import config as C
from .. import protocol as P
from ..errors import HpctError
from ..events import Ev, Role
from ..fault_count import CountingLog
from ..fdlimit import nofile_fields, raise_nofile
from ..rundir import private_dir
from ..slurm.client import SlurmClient
from .accepting import Listener
from .connections import Conn, Connections, Link
from .detection import IN_PROCESS, IN_PROCESS_GRACE_S, Detection
from .ending import (EXIT_FAILED, EXIT_OK, EXIT_RETRY, EXIT_TERMINATED, Ending,
                     ScriptError)
from .fencing import Fencing, slurmd_reachable
from .failslow import FailSlow
from .lifecycle import Lifecycle
from .options import Options
from .pacing import pace, relayed
from .policy import RecoveryRecord, World, initial_shards, split_allocation
from .recovery_round import RecoveryRound
from .spares import Spares
from .steps import StepSpawner, Steps, spawn_srun

# What other modules and the tests take from here (the pieces' own modules hold them).
__all__ = ["Controller", "Options", "Conn", "Link", "ScriptError", "StepSpawner", "spawn_srun",
           "slurmd_reachable", "main_from_env", "IN_PROCESS", "IN_PROCESS_GRACE_S", "EXIT_OK",
           "EXIT_FAILED", "EXIT_RETRY", "EXIT_TERMINATED"]


class Controller(Connections, Steps, Detection, RecoveryRound, Fencing, Spares, Ending):
    """The batch host's controller: one job's state, and the run that ends with its exit
    code. Its behaviour comes from the pieces it is made of (the module's docstring)."""

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
        # counting its faults as it writes them: the rule `status` applies to the same records
        self.events = CountingLog(self.run_dir / "controller.jsonl", source="controller")
        secret_path = self.run_dir / "secret"
        self.secret = (P.load_secret(secret_path) if secret_path.exists()
                       else P.new_secret_file(secret_path))
        self.secret_path = secret_path
        self.job = str(opts.job_id)
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
        self.heard_from: set[str] = set()  # nodes whose step now running has registered
        self.dead_nodes: set[str] = set()
        self.expected_exits: set[int] = set()  # pids of steps we cancelled ourselves
        self.fencing: dict[str, asyncio.Future[None]] = {}  # live nodes: step cancel under way
        self.borrowed: list[int] = []  # companion jobs submitted into the spare pool
        self.pool_nodes: set[str] = set()
        # how long a round short of ready spares waits for one on its way (arrivals.py)
        self.spare_wait_s: float = C.read(os.environ, C.SPARE_WAIT_S)
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
        # Once every connection was told goodbye (why), a rank registering later is told the
        # same at once: a spare relaunched just before the end would wait out the grace
        self.goodbye_reason: str | None = None
        # A rank said the script raised an error it would raise on any node (connections.py):
        # the job ends as the script's, and the exits that follow are no fault
        self.script_error: str | None = None
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
        self.failslow = FailSlow(self)  # a node that drags the job moves out (failslow.py)
        if opts.store == "tcpstore":
            # Stock TCPStore has no authentication: say so where the admin and the user look.
            warning = ("the tcpstore rendezvous is not authenticated: any host that reaches "
                       "MASTER_PORT can read and overwrite its keys; use --store rootless on a "
                       "shared network (docs/admin.md)")
            self.events.emit(Ev.CONTROLLER_STORE_UNAUTHENTICATED, store="tcpstore",
                             warning=warning)
            print(f"hpct-slurm: warning: {warning}", file=sys.stderr)

    async def run(self) -> int:
        nofile = raise_nofile()  # before the listener: a full table stops accepting ranks
        host = _resolve(self.o.batch_host)
        server = Listener(host, self._serve, self.events)  # accepting.py: not start_server
        # `--signal=B:TERM@N` (or scancel -b -s TERM) reaches the batch shell, which execs us:
        # say goodbye to every rank (each closes its persister) and end with 143.
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGTERM, lambda: asyncio.ensure_future(self._terminate("SIGTERM")))
        self.address = server.address
        self.events.emit(Ev.CONTROLLER_START, job_id=self.o.job_id, active=self.world.members,
                         spares=self.world.spares, tasks_per_node=self.o.tasks_per_node,
                         store=self.o.store,
                         address=f"{self.address[0]}:{self.address[1]}",
                         command=self.o.command, **nofile_fields(nofile))
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
            await self.lifecycle.drain_corrupt_left()
        finally:
            for t in tasks:
                t.cancel()
            server.close()
            await self._stop_steps()
            await self._release_borrowed()
        self.events.emit(Ev.CONTROLLER_EXIT, code=self.exit_code)
        return self.exit_code


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise HpctError(f"batch host {host!r} does not resolve: {exc}") from exc


def main_from_env(command: list[str], run_dir: str | None, **settings: object) -> int:
    """Run the controller of the job this process's Slurm environment names. `settings` are
    `Options` fields (the command line's, cli.run); what is left out takes Options' default."""
    from ..slurm.env import SlurmEnv

    env = SlurmEnv.from_environ()
    if not command:
        raise HpctError("controller needs the training command after --")
    batch_host = env.node_name or socket.gethostname()
    rd = Path(run_dir or C.read(os.environ, C.RUN_DIR) or
              Path(env.submit_dir or os.getcwd()) / f"hpct-{env.job_id}")
    opts = Options(command=command, run_dir=rd, job_id=env.job_id, nodes=env.job_nodelist,
                   batch_host=batch_host, restart_count=env.restart_count,
                   **settings)  # type: ignore[arg-type]
    try:
        return asyncio.run(Controller(opts).run())
    except KeyboardInterrupt:
        print("controller interrupted", file=sys.stderr)
        return 130
