"""The fast tier (issue 14, item 4): the Controller's state machine in seconds, without Slurm.

The real Controller runs on the test's event loop, with three stand-ins:

* FakeSlurmRunner, the SlurmClient's injected `runner`: answers `scontrol show node`,
  `sinfo --json`, `squeue -s`, `scancel`, `scontrol update` and `scontrol requeue` from the
  FakeCluster's view, and records every argv.
* FakeStep, what the controller's `spawn_step` seam returns instead of an `srun` subprocess:
  it starts the node's FakeRank and ends when the test (or a `scancel`) ends it.
* FakeRank, a real protocol client over loopback (protocol.Channel, the job's secret from the
  HPCT_SECRET_FILE the controller put in the step's environment): registers, heartbeats,
  reports StepDone, answers a STOP with Holdings and a `ready` heartbeat, leaves on Goodbye.

Whether a node's slurmd answers is the real check (controller.slurmd_reachable): a live node's
NodeAddr is 127.0.0.1, where the FakeCluster listens on Options.slurmd_port; a crashed node's
is 127.0.0.2, where nothing listens (the connection is refused at once).
"""
from __future__ import annotations

import asyncio
import resource
import itertools
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Awaitable, Callable

import pytest

from hpct_slurm import protocol as P
from hpct_slurm.controller import controller as C
from hpct_slurm.events import read_events
from hpct_slurm.report.cli import load_run
from hpct_slurm.report.model import build_status
from hpct_slurm.slurm.client import SlurmClient

JOB = 4242
ALIVE_ADDR, DEAD_ADDR = "127.0.0.1", "127.0.0.2"
TEST_TIMEOUT_S = 12.0
_PIDS = itertools.count(700001)
_PORTS = itertools.count(41001)


class FakeRank:
    """One training process, as far as the controller can tell: the protocol, no torch."""

    def __init__(self, step: "FakeStep", local_rank: int, env: dict[str, str]):
        self.step_proc = step
        self.node, self.local_rank = step.node, local_rank
        self.role = env["HPCT_ROLE"]
        host, _, port = env["HPCT_CONTROLLER"].rpartition(":")
        self.address = (host, int(port))
        self.secret = P.load_secret(env["HPCT_SECRET_FILE"])
        self.host_addr = step.cluster.host_addr(step.node)
        self.transfer_port = next(_PORTS)
        self.rank = self.generation = self.step = -1
        self.state = "registering"
        self.own_time = (-1.0, 0)  # its heartbeat's own time per step (median, window fill)
        self.own: list[int] = []  # steps of its snapshot, what Holdings reports
        # What it does on a STOP: "ready" (Holdings, then a ready heartbeat), "ignore" (a hung
        # process: keeps heartbeating "running"), "die" (its node crashes), or a coroutine
        # function (rank, stop) for anything else.
        self.on_stop = step.cluster.on_stop.get(step.node, "ready")
        self.beating = True
        self.assigns: list[P.Assign] = []
        self.stops: list[P.Stop] = []
        self.goodbyes: list[P.Goodbye] = []
        self.closed = False
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        try:
            self.reader, self.writer = await asyncio.open_connection(*self.address)
            self.chan = await P.client_hello_async(self.reader, self.secret, str(JOB))
        except (OSError, P.ProtocolError):
            self.closed = True  # the controller is gone: the process exits
            self.step_proc.exit(1)
            return
        gate = self.step_proc.cluster.register_gate
        if gate is not None:
            await gate.wait()
        await self.send(P.Register(str(JOB), self.node, self.local_rank, self.role, os.getpid(),
                                   self.host_addr, self.transfer_port))
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._beat())]

    async def send(self, msg) -> None:
        if self.closed:
            return
        try:
            await self.chan.write(self.writer, msg)
        except (OSError, ConnectionError):
            pass

    async def heartbeat(self, generation: int | None = None, state: str | None = None) -> None:
        await self.send(P.Heartbeat(self.rank, self.generation if generation is None
                                    else generation, self.step, state or self.state,
                                    *self.own_time))

    async def train(self, upto: int) -> None:
        """Steps up to `upto`, each reported; the snapshot keeps the last two."""
        for s in range(self.step + 1, upto + 1):
            self.step = s
            self.own = [x for x in (s - 1, s) if x >= 0]
            await self.send(P.StepDone(self.rank, self.generation, s))

    async def holdings(self, own: list[int] | None = None, generation: int | None = None) -> None:
        await self.send(P.Holdings(self.rank, self.generation if generation is None
                                   else generation, "jit", False,
                                   self.own if own is None else own, [], {}))

    async def ready(self) -> None:
        await self.holdings()
        self.state = "ready"
        await self.heartbeat()

    async def finish(self) -> None:
        self.state = "done"
        await self.heartbeat()

    def crash(self) -> None:
        """The process is gone without a word (its connection reset)."""
        if self.closed:
            return
        self.closed = True
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self.writer.transport.abort()

    async def _read(self) -> None:
        try:
            while True:
                msg = (await self.chan.read(self.reader)).msg
                if isinstance(msg, P.Assign):
                    self.assigns.append(msg)
                    self.rank, self.generation = msg.rank, msg.generation
                    self.step = msg.restore_step
                    self.own = [msg.restore_step] if msg.restore_step >= 0 else []
                    self.state = "running"
                elif isinstance(msg, P.Stop):
                    self.stops.append(msg)
                    await self._stopped(msg)
                elif isinstance(msg, P.Goodbye):
                    self.goodbyes.append(msg)
                    await self.send(P.Goodbye("done" if msg.reason == "done" else msg.reason))
                    self.crash()
                    self.step_proc.exit(0)
                    return
        except (P.ProtocolError, OSError, ConnectionError):
            self.closed = True  # cut by the controller (a fence): the step lives until scancel

    async def _stopped(self, stop: P.Stop) -> None:
        if self.on_stop == "ready":
            await self.ready()
        elif self.on_stop == "die":
            self.step_proc.cluster.alive[self.node] = False
            self.crash()
            self.step_proc.exit(1)
        elif callable(self.on_stop):
            await self.on_stop(self, stop)

    async def _beat(self) -> None:
        while not self.closed:
            if self.beating:
                await self.heartbeat()
            await asyncio.sleep(0.1)


class FakeStep:
    """What `spawn_step` returns in place of an srun process: pid, stderr, wait(), kill()."""

    def __init__(self, cluster: "FakeCluster", node: str, role: str, argv: list[str],
                 env: dict[str, str]):
        self.cluster, self.node, self.role, self.argv = cluster, node, role, argv
        self.pid = next(_PIDS)
        self.number = next(cluster.step_numbers)  # JOB.number in squeue
        self.stderr = asyncio.StreamReader()
        self.returncode: int | None = None
        self._done = asyncio.Event()
        assert argv[:5] == ["srun", "-N1", argv[2], "-w", node] and f"--jobid={JOB}" in argv
        tpn = int(argv[2].removeprefix("-n"))
        self.ranks = [FakeRank(self, local, env) for local in range(tpn)]

    def exit(self, rc: int, stderr: str = "") -> None:
        if self.returncode is not None:
            return
        for r in self.ranks:
            r.crash()
        if stderr:
            self.stderr.feed_data(stderr.encode())
        self.stderr.feed_eof()
        self.returncode = rc
        self._done.set()

    async def wait(self) -> int:
        await self._done.wait()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        self.exit(-9)


class FakeSlurmRunner:
    """SlurmClient's `runner`: answers the commands the controller runs (from worker threads)
    out of the FakeCluster's view, and records them; anything else fails and is kept in
    `unexpected`."""

    def __init__(self, cluster: "FakeCluster"):
        self.cluster = cluster
        self.argvs: list[list[str]] = []
        self.unexpected: list[list[str]] = []

    def __call__(self, argv, **kwargs) -> subprocess.CompletedProcess:
        argv = list(argv)
        self.argvs.append(argv)
        out = self.answer(argv)
        if isinstance(out, tuple):  # ("fail", stderr): Slurm refuses the command
            return subprocess.CompletedProcess(argv, 1, stdout="", stderr=out[1])
        if out is None:
            self.unexpected.append(argv)
            return subprocess.CompletedProcess(argv, 1, stdout="",
                                               stderr=f"FakeSlurmRunner: no answer for {argv}")
        return subprocess.CompletedProcess(argv, 0, stdout=out, stderr="")

    def answer(self, argv: list[str]) -> str | tuple[str, str] | None:
        c = self.cluster
        match argv:
            case ["scontrol", "show", "node", "-o", name] if name in c.alive:
                time.sleep(c.show_node_delay_s)
                addr = ALIVE_ADDR if c.alive[name] else DEAD_ADDR
                reason = f" Reason={c.reason[name]}" if name in c.reason else ""
                return (f"NodeName={name} Arch=x86_64 CoresPerSocket=1 NodeAddr={addr} "
                        f"NodeHostName={name} State={c.state[name]} Partitions=debug"
                        f"{reason}\n")
            case ["sinfo", "--json"]:
                return json.dumps({"nodes": [{"name": n, "state": c.state[n], "state_flags": [],
                                              "reason": c.reason.get(n)} for n in c.nodes]})
            case ["squeue", "-h", "-s", "-j", job, "-o", "%i %N"] if job == str(JOB):
                running = [f"{JOB}.{s.number} {s.node}" for s in list(c.steps)
                           if s.returncode is None]
                return "\n".join([f"{JOB}.batch {c.nodes[0]}", *running]) + "\n"
            case ["scancel", "--signal=KILL", target]:
                for s in list(c.steps):
                    # a node in `stuck` has its slurmstepd stopped: the cancel does not land
                    if target == f"{JOB}.{s.number}" and s.node not in c.stuck:
                        c.loop.call_soon_threadsafe(s.exit, -9)
                return ""
            case ["scontrol", "update", node_arg, "State=DOWN", *_]:
                c.state[node_arg.removeprefix("NodeName=")] = "DOWN"
                return ""
            case ["scontrol", "requeue", job] if job == str(JOB):
                return ""
            case ["scancel", job] if job in {str(j) for j in c.companions}:
                c.companions.remove(int(job))  # a pool companion job, cancelled
                return ""
            case ["scontrol", "update", job_arg, start] if job_arg == f"JobId={JOB}" \
                    and start.startswith("StartTime="):
                c.begins.append(start.removeprefix("StartTime="))
                return ""
            case ["scontrol", "update", job_arg, comment] if job_arg == f"JobId={JOB}" \
                    and comment.startswith("Comment="):
                time.sleep(c.comment_delay_s)
                if c.comment_refusals:
                    c.comment_refusals -= 1
                    return ("fail", "Job update not available right now, the DB index is "
                                    "being set, try again in a bit for job 4242\n")
                c.comments.append(comment.removeprefix("Comment="))
                return ""
            case ["scontrol", "show", "reservation", "-o"]:
                return "\n".join(c.reservations) + "\n" if c.reservations else \
                    "No reservations in the system\n"
            case ["scontrol", "show", "job", "-o", job] if job == str(JOB):
                return (f"JobId={JOB} JobName=train UserId=root(0) JobState=RUNNING "
                        f"Restarts=0 ExitCode=0:0 EndTime={c.job_end} NodeList=x\n")
            case ["scontrol", "reboot", "ASAP", "nextstate=RESUME", _, node_arg]:
                c.state[node_arg] = "DOWN+REBOOT_REQUESTED"
                return ""
            case ["scontrol", "update", node_arg, "State=DRAIN", reason]:
                name = node_arg.removeprefix("NodeName=")
                c.reason[name] = reason.removeprefix("Reason=")
                if "DRAIN" not in c.state[name]:  # as slurmctld: drained from now on
                    c.state[name] += "+DRAIN"
                return ""
        return None


class FakeCluster:
    """A job's allocation, nodes[0] being the batch host ("localhost": the controller listens
    where it resolves), and the Controller running on it."""

    def __init__(self, tmp_path: Path, nodes: list[str], spares: int, **options):
        self.nodes = nodes
        self.alive = {n: True for n in nodes}
        self.state = {n: "ALLOCATED" for n in nodes}
        self.reason: dict[str, str] = {}  # node -> its Slurm Reason (a drain's)
        self.comments: list[str] = []  # the job's Slurm Comment, each update
        self.comment_refusals = 0  # so many comment updates fail first ("try again")
        self.comment_delay_s = 0.0  # each comment update takes this long (a slurmctld waiting)
        self.begins: list[str] = []  # the job's StartTime, each update (after a requeue)
        self.reservations: list[str] = []  # `scontrol show reservation -o` lines
        self.job_end = "2099-01-01T00:00:00"
        self.on_stop: dict[str, object] = {}
        self.steps: list[FakeStep] = []
        self.step_numbers = itertools.count(0)
        self.show_node_delay_s = 0.0
        self.stuck: set[str] = set()  # nodes whose step a scancel does not end (stopped stepd)
        self.companions: list[int] = []  # pool companion jobs in the queue (ids)
        # set: every rank connects, then holds its Register until the test sets it
        self.register_gate: asyncio.Event | None = None
        self.runner = FakeSlurmRunner(self)
        defaults = dict(heartbeat_timeout_s=2.0, ready_timeout_s=3.0, node_poll_s=0.3)
        self.options = C.Options(command=["python", "train.py"], run_dir=tmp_path / "run",
                                 job_id=JOB, nodes=nodes, batch_host=nodes[0], spares=spares,
                                 **{**defaults, **options})

    def host_addr(self, node: str) -> str:
        return f"10.0.0.{self.nodes.index(node) + 1}"

    async def spawn(self, node: str, role: str, argv: list[str], env: dict[str, str],
                    log) -> FakeStep:
        step = FakeStep(self, node, role, argv, env)
        self.steps.append(step)
        for r in step.ranks:
            await r.start()
        return step

    async def __aenter__(self) -> "FakeCluster":
        self.loop = asyncio.get_running_loop()
        self.slurmd = await asyncio.start_server(lambda r, w: w.close(), ALIVE_ADDR, 0)
        self.options.slurmd_port = self.slurmd.sockets[0].getsockname()[1]
        self.ctl = C.Controller(self.options, client=SlurmClient(runner=self.runner),
                                spawn_step=self.spawn)
        self.job = asyncio.create_task(self.ctl.run())
        return self

    async def __aexit__(self, *exc) -> None:
        for s in list(self.steps):
            s.exit(-9)
        if not self.job.done():
            await self.ctl._terminate("test over")
        await asyncio.wait_for(self.job, 5)
        self.slurmd.close()
        if exc[0] is None:
            assert self.runner.unexpected == []

    # ---- looking -------------------------------------------------------------------------
    def events(self, name: str) -> list[dict]:
        path = self.options.run_dir / "controller.jsonl"
        return [e for e in read_events(path) if e["event"] == name] if path.exists() else []

    def rank(self, node: str, local_rank: int = 0) -> FakeRank:
        """The newest process on `node`."""
        return [s for s in self.steps if s.node == node][-1].ranks[local_rank]

    async def until(self, pred: Callable[[], object], what: str, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while not (got := pred()):
            assert not self.job.done(), f"the controller ended ({self.job.result()}) " \
                                        f"while waiting for {what}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s"
            await asyncio.sleep(0.02)
        return got

    async def assigned(self, node: str, generation: int) -> P.Assign:
        def find():
            if not any(s.node == node for s in self.steps):
                return None
            return next((a for a in self.rank(node).assigns if a.generation == generation), None)
        return await self.until(find, f"generation {generation} assigned to {node}")

    # ---- doing ---------------------------------------------------------------------------
    async def started(self) -> None:
        """Generation 0 assigned and every spare registered."""
        for n in self.ctl.world.members:
            await self.assigned(n, 0)
        for n in list(self.ctl.world.spares):
            await self.until(lambda: (n, 0) in self.ctl.conns, f"spare {n} registered")

    async def train(self, nodes: list[str], upto: int) -> None:
        for n in nodes:
            await self.rank(n).train(upto)

    async def crash(self, node: str, rc: int = 0, dead: bool = True, stderr: str = "",
                    step_exit_after_s: float = 0.0) -> None:
        """The node's process dies (its connection resets); `dead`: with its node (slurmd no
        longer answers). The step exits `step_exit_after_s` later, printing `stderr`."""
        self.alive[node] = not dead
        step = [s for s in self.steps if s.node == node][-1]
        for r in step.ranks:
            r.crash()
        if step_exit_after_s:
            await asyncio.sleep(step_exit_after_s)
        step.exit(rc, stderr)

    async def finish(self) -> int:
        """Every active rank reports done; the controller's exit code."""
        for n in self.ctl.world.members:
            await self.rank(n).finish()
        return await asyncio.wait_for(asyncio.shield(self.job), 5)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), TEST_TIMEOUT_S))


# ---- the tests -----------------------------------------------------------------------------------

def test_generation_0_is_assigned_once_when_spares_register_with_the_last_member(tmp_path):
    async def scenario():
        c = FakeCluster(tmp_path, ["localhost", "a1", "s1", "s2"], spares=2)
        c.register_gate = asyncio.Event()
        async with c:
            await c.until(lambda: len(c.ctl.unregistered) == 4, "4 connections")
            c.register_gate.set()  # members and spares register in the same moment
            await c.started()
            await asyncio.sleep(0.1)
            assert [e["generation"] for e in c.events("generation.start")] == [0]
            for n in ("localhost", "a1"):
                assert [a.generation for a in c.rank(n).assigns] == [0]
            assert c.rank("s1").assigns == c.rank("s2").assigns == []
            await c.train(["localhost", "a1"], 1)
            assert await c.finish() == 0
    run(scenario)


def test_a_member_lost_before_generation_0_is_replaced_without_a_round(tmp_path):
    """Issue 30: a node that dies while the ranks register. Its survivors hold no generation
    and would never answer a STOP: a round used to fence them "not ready (registering)" and
    requeue the job. Now the spare takes the position and generation 0 starts."""
    async def scenario():
        c = FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1)
        c.register_gate = asyncio.Event()
        async with c:
            await c.until(lambda: len(c.ctl.unregistered) == 3, "3 connections")
            await c.crash("a1")  # before any rank registered
            c.register_gate.set()
            [ev] = await c.until(lambda: c.events("fault.before_start"), "fault.before_start")
            assert ev["lost"] == ["a1"] and ev["taken"] == {"a1": "s1"}
            a = await c.assigned("s1", 0)
            assert (a.rank, a.world_size, a.restore_step, a.members) == (
                1, 2, -1, ["localhost", "s1"])
            assert [x.generation for x in c.rank("localhost").assigns] == [0]
            assert c.rank("localhost").stops == []  # nothing to stop: nothing had formed
            assert not c.events("fault.fenced") or all(
                e["node"] == "a1" for e in c.events("fault.fenced"))
            assert not c.events("recovery.failed") and not c.events("fault.second")
            await c.train(["localhost", "s1"], 2)
            assert await c.finish() == 0
    run(scenario)


@pytest.mark.parametrize("srun_rc", [0, 1], ids=["slurm22.05-exit0", "slurm24.11-exit1"])
def test_a_spare_takes_the_lost_rank_and_restores_from_the_survivors_holdings(tmp_path, srun_rc):
    # srun exits 0 on a node failure in Slurm 22.05, 1 in 24.11 and 26.05: the same recovery
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            first = c.rank("a1").assigns[0]
            assert (first.rank, first.world_size, first.restore_step) == (1, 2, -1)
            assert c.ctl.world.spares == ["s1"] and c.rank("s1").assigns == []
            await c.train(["localhost", "a1"], 4)
            await c.crash("a1", rc=srun_rc, stderr="srun: error: Node failure on a1\n")

            a = await c.assigned("s1", 1)
            assert (a.rank, a.world_size, a.restore_step) == (1, 2, 4)
            assert a.members == ["localhost", "s1"]
            # the survivor is the one source, under its transfer address
            lh = c.rank("localhost")
            assert a.sources == {0: [(lh.host_addr, lh.transfer_port)]}
            [stop] = lh.stops
            assert stop.generation == 0 and stop.lost_addrs == [c.host_addr("a1")]
            b = await c.assigned("localhost", 1)
            assert (b.rank, b.restore_step) == (0, 4)
            [ev] = c.events("recovery.assign")
            assert ev["taken"] == {"a1": "s1"} and ev["restore_step"] == 4
            assert ev["sources"] == {"0": "own", "1": "peer"}
            [fenced] = c.events("fault.fenced")
            assert (fenced["node"], fenced["how"]) == ("a1", "node down")
            assert any(argv[:4] == ["scontrol", "update", "NodeName=a1", "State=DOWN"]
                       for argv in c.runner.argvs)

            await c.train(["localhost", "s1"], 5)
            [done] = await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert (done["generation"], done["restore_step"], done["lost"]) == (1, 4, ["a1"])
            assert await c.finish() == 0
            assert [e["code"] for e in c.events("controller.exit")] == [0]
            [jd] = c.events("job.done")
            assert jd["generation"] == 1 and jd["lost"] == ["a1"]
            assert lh.goodbyes[-1].reason == "done"
    run(scenario)


@pytest.mark.parametrize("on_no_spare", ["requeue", "fail"])
def test_a_loss_beyond_the_spares_escalates(tmp_path, on_no_spare):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1"], spares=0,
                               on_no_spare=on_no_spare) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            await c.crash("a1")
            code = await asyncio.wait_for(asyncio.shield(c.job), 5)
            # requeued: "retry" to Slurm's requeue logic (RequeueExit=75); the user's "fail"
            # is not a retry
            want = 75 if on_no_spare == "requeue" else 1
            assert code == want
            [failed] = c.events("recovery.failed")
            assert "1 node(s) lost (a1) but only 0 warm spare(s) ready" in failed["error"]
            requeues = [argv for argv in c.runner.argvs if argv[:2] == ["scontrol", "requeue"]]
            if on_no_spare == "requeue":
                [ev] = c.events("escalate.requeue")
                assert requeues == [["scontrol", "requeue", str(JOB)]]
            else:
                [ev] = c.events("escalate.fail")
                assert requeues == []
            assert ev["cause"] == "infrastructure"
            assert c.events("recovery.assign") == []
            assert c.rank("localhost").goodbyes[0].reason.startswith("job escalated:")
            assert [e["code"] for e in c.events("controller.exit")] == [want]
    run(scenario)


def test_a_second_fault_during_recovery_is_folded_into_the_same_round(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1", "s2"], spares=2) as c:
            c.on_stop["a2"] = "die"  # a2's node crashes right after the STOP
            await c.started()
            assert c.ctl.world.members == ["localhost", "a1", "a2"]
            await c.train(["localhost", "a1", "a2"], 3)
            await c.crash("a1")

            s1, s2 = await c.assigned("s1", 1), await c.assigned("s2", 1)
            assert (s1.rank, s1.restore_step, s2.rank, s2.restore_step) == (1, 3, 2, 3)
            assert s1.members == ["localhost", "s1", "s2"]
            [second] = c.events("fault.second")
            assert second["nodes"] == ["a2"] and second["during"] == "recovery"
            [ev] = c.events("recovery.assign")  # one round, one new generation
            assert ev["generation"] == 1 and ev["taken"] == {"a1": "s1", "a2": "s2"}
            assert len(c.rank("localhost").stops) == 1
            assert sorted(e["node"] for e in c.events("fault.fenced")) == ["a1", "a2"]

            await c.train(["localhost", "s1", "s2"], 4)
            [done] = await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert done["lost"] == ["a1", "a2"]
            assert await c.finish() == 0
            assert c.ctl.world.generation == 1
    run(scenario)


def test_the_same_loss_seen_twice_is_one_fault(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            # a1's process dies, its node lives: EOF first, then its step exits with the
            # error, while the round that the EOF started is still fencing a1 (slow scontrol)
            c.show_node_delay_s = 0.3
            await c.crash("a1", rc=1, dead=False, stderr="RuntimeError: boom\n",
                          step_exit_after_s=0.05)

            a = await c.assigned("s1", 1)
            assert (a.rank, a.restore_step) == (1, 2)
            reasons = [e["reason"] for e in c.events("fault.detected")]
            assert reasons == ["connection lost", "step exited (1)"]
            assert c.events("fault.second") == []
            [ev] = c.events("recovery.assign")
            assert ev["taken"] == {"a1": "s1"}
            [fenced] = c.events("fault.fenced")
            assert fenced["how"] == "step cancelled"  # a live node is not marked DOWN
            assert c.state["a1"] == "ALLOCATED"
            exits = [e for e in c.events("step.exit") if e["node"] == "a1"]
            assert exits[0]["error"] == "RuntimeError: boom"
            # the healthy node comes back as a warm spare
            await c.until(lambda: c.ctl.world.spares == ["a1"] and ("a1", 0) in c.ctl.conns
                          and not c.ctl.conns[("a1", 0)].gone, "a1 back as a spare")
            assert c.rank("a1").role == "spare"

            await c.train(["localhost", "s1"], 3)
            await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert await c.finish() == 0
            assert c.ctl.world.generation == 1
    run(scenario)


def test_a_survivor_that_never_becomes_ready_is_lost_too(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1", "s2"], spares=2,
                               ready_timeout_s=1.0) as c:
            c.on_stop["a1"] = "ignore"  # hung: heartbeats go on, it never gets ready
            await c.started()
            await c.train(["localhost", "a1", "a2"], 3)
            hung = c.rank("a1")
            await c.crash("a2")

            s1, s2 = await c.assigned("s1", 1), await c.assigned("s2", 1)
            assert (s1.rank, s2.rank, s1.restore_step) == (1, 2, 3)
            lh = c.rank("localhost")
            assert s1.sources == {0: [(lh.host_addr, lh.transfer_port)]}
            [second] = c.events("fault.second")
            assert second["nodes"] == ["a1"]
            fenced = {e["node"]: e for e in c.events("fault.fenced")}
            assert fenced["a1"]["reason"] == "not ready after fault (running)"
            assert fenced["a1"]["how"] == "step cancelled"
            assert fenced["a2"]["how"] == "node down"
            [ev] = c.events("recovery.assign")
            assert ev["taken"] == {"a1": "s1", "a2": "s2"}
            # the hung process's step was cancelled through Slurm, and it got no assignment
            a1_step = [s for s in c.steps if s.node == "a1"][0]
            assert ["scancel", "--signal=KILL", f"{JOB}.{a1_step.number}"] in c.runner.argvs
            assert a1_step.returncode == -9 and hung.closed
            assert [a.generation for a in hung.assigns] == [0]

            await c.train(["localhost", "s1", "s2"], 4)
            await c.until(lambda: c.events("recovery.done"), "recovery.done")
            # a1 (alive) comes back as a spare before the job ends: let it register
            await c.until(lambda: ("a1", 0) in c.ctl.conns and not c.ctl.conns[("a1", 0)].gone,
                          "a1 back as a spare")
            assert await c.finish() == 0
    run(scenario)


def test_messages_of_an_older_generation_are_ignored(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1", "s2"], spares=2) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            await c.crash("a1")
            await c.assigned("s1", 1)
            lh, s1 = c.rank("localhost"), c.rank("s1")
            await c.assigned("localhost", 1)
            assert (lh.generation, s1.generation, s1.rank) == (1, 1, 1)

            # StepDone of the first step after the restore, from generations past: dropped
            # quietly (accepted, it would complete the recovery)
            await lh.send(P.StepDone(0, 0, 3))
            await s1.send(P.StepDone(1, -1, 3))
            await asyncio.sleep(0.3)
            assert c.events("recovery.done") == []
            assert c.events("protocol.rejected") == []
            await c.train(["localhost", "s1"], 3)
            [done] = await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert done["generation"] == 1

            # a `ready` heartbeat of generation 0 (a rank still finishing its last one), with no
            # current heartbeat after it: accepted, it would read as the rank failing on its
            # own and start an in-process restart after IN_PROCESS_GRACE_S
            lh.beating = False
            await lh.heartbeat(generation=0, state="ready")
            await asyncio.sleep(C.IN_PROCESS_GRACE_S + 0.6)
            assert len(c.events("fault.detected")) == 1
            assert c.ctl.conns[("localhost", 0)].state == "running"
            lh.beating = True

            # after a second fault, a Holdings of an older generation arriving after the
            # current one does not replace it (accepted: restore step 9, held by nobody)
            await c.train(["localhost", "s1"], 5)

            async def stale_holdings(rank: FakeRank, stop: P.Stop) -> None:
                await rank.holdings()  # [4, 5], generation 1
                await rank.holdings(own=[9], generation=0)
                rank.state = "ready"
                await rank.heartbeat()
            lh.on_stop = stale_holdings
            await c.crash("s1")
            a = await c.assigned("s2", 2)
            assert (a.rank, a.restore_step) == (1, 5)
            [_, ev] = c.events("recovery.assign")
            assert ev["generation"] == 2 and ev["taken"] == {"s1": "s2"}
            await c.train(["localhost", "s2"], 6)
            await c.until(lambda: len(c.events("recovery.done")) == 2, "second recovery.done")
            assert await c.finish() == 0
    run(scenario)


def test_a_rank_that_reports_its_own_fault_restarts_in_place(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 3)
            await c.rank("a1").ready()  # an exception in its step: ready, nobody stopped it
            b = await c.assigned("a1", 1)
            assert (b.rank, b.restore_step, b.members) == (1, 3, ["localhost", "a1"])
            assert (await c.assigned("localhost", 1)).restore_step == 3
            [fault] = c.events("fault.detected")
            assert (fault["node"], fault["reason"]) == ("a1", C.IN_PROCESS)
            [inp] = c.events("fault.in_process")
            assert inp["nodes"] == ["a1"]
            [ev] = c.events("recovery.assign")
            assert ev["taken"] == {} and ev["members"] == ["localhost", "a1"]
            assert c.events("fault.fenced") == [] and c.rank("s1").assigns == []
            assert not any(argv[0] == "scancel" for argv in c.runner.argvs)
            await c.train(["localhost", "a1"], 4)
            await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert await c.finish() == 0
    run(scenario)


def test_a_node_slurm_marks_down_is_replaced(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            c.state["a1"] = "DOWN"  # our connection to it still looks fine
            a = await c.assigned("s1", 1)
            assert (a.rank, a.restore_step) == (1, 2)
            [fault] = c.events("fault.detected")
            assert (fault["node"], fault["reason"]) == ("a1", "slurm: node down")
            [fenced] = c.events("fault.fenced")
            assert fenced["how"] == "node unavailable in slurm"
            assert "a1" in c.ctl.dead_nodes
            [s for s in c.steps if s.node == "a1"][-1].exit(0)  # Slurm ends its step
            await c.train(["localhost", "s1"], 3)
            await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert await c.finish() == 0
            assert c.ctl.world.spares == []  # a1 never comes back
    run(scenario)


def test_the_same_error_on_two_nodes_before_the_first_step_is_the_scripts(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            error = "ModuleNotFoundError: No module named 'nope'\n"
            await c.crash("localhost", rc=1, dead=False, stderr=error)
            await c.crash("a1", rc=1, dead=False, stderr=error)
            assert await asyncio.wait_for(asyncio.shield(c.job), 5) == 1
            [failed] = c.events("job.failed")
            assert failed["cause"] == "script"
            assert "before its first step on localhost, a1" in failed["reason"]
            assert "No module named 'nope'" in failed["reason"]
            assert c.events("escalate.requeue") == []
            assert not any(argv[:2] == ["scontrol", "requeue"] for argv in c.runner.argvs)
            assert [e["code"] for e in c.events("controller.exit")] == [1]
            # and the job's Slurm comment says so (the escalation waits for its comment)
            assert c.comments and \
                "failed, not requeued: the script's own error" in c.comments[-1]
    run(scenario)


def test_no_spare_left_with_shrink_spreads_the_lost_shard_over_the_survivors(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2"], spares=0,
                               on_no_spare="shrink") as c:
            await c.started()
            assert [c.rank(n).assigns[0].data_ranks for n in ("localhost", "a1", "a2")] == \
                [[0], [1], [2]]
            await c.train(["localhost", "a1", "a2"], 3)
            await c.crash("a2")

            lh, a1 = await c.assigned("localhost", 1), await c.assigned("a1", 1)
            [shrunk] = c.events("recovery.shrink")
            assert shrunk["lost"] == ["a2"] and shrunk["members"] == ["localhost", "a1"]
            assert shrunk["shards"] == {"localhost": [0, 2], "a1": [1]}
            # the same global batch: the world shrinks, the data world does not
            assert (lh.world_size, lh.data_ranks, lh.restore_step) == (2, [0, 2], 3)
            assert (a1.rank, a1.data_ranks) == (1, [1])
            assert lh.data_world == a1.data_world == 3
            [ev] = c.events("recovery.assign")
            assert ev["taken"] == {} and ev["members"] == ["localhost", "a1"]
            assert c.events("recovery.failed") == [] and c.events("escalate.requeue") == []

            await c.train(["localhost", "a1"], 4)
            [done] = await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert (done["lost"], done["taken"], done["restore_step"]) == (["a2"], {}, 3)
            assert await c.finish() == 0
    run(scenario)


def test_a_second_fault_that_leaves_too_few_spares_escalates(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1"], spares=1) as c:
            c.on_stop["a2"] = "die"
            await c.started()
            await c.train(["localhost", "a1", "a2"], 3)
            await c.crash("a1")
            assert await asyncio.wait_for(asyncio.shield(c.job), 5) == 75  # requeued: "retry"
            [second] = c.events("fault.second")
            assert second["nodes"] == ["a2"]
            [failed] = c.events("recovery.failed")
            assert failed["error"] == "2 node(s) lost (a1, a2) but only 1 warm spare(s) ready"
            [ev] = c.events("escalate.requeue")
            assert ev["reason"] == failed["error"] and ev["cause"] == "infrastructure"
            assert ["scontrol", "requeue", str(JOB)] in c.runner.argvs
            assert c.events("recovery.assign") == [] and c.rank("s1").assigns == []
    run(scenario)


def test_a_rank_whose_state_and_ring_copy_are_both_lost_escalates_to_requeue(tmp_path):
    """Per-rank state (a sampler position): rank 1's own copy was on a1, its ring copy on a2;
    both nodes are lost, nothing is on disk: no step every rank reaches, the job requeues (it
    never trains on from mixed state, nor restarts from scratch mid-run)."""
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1", "s2"], spares=2) as c:
            async def holds_rank_2s_copy(rank: FakeRank, stop: P.Stop) -> None:
                steps = rank.own
                await rank.send(P.Holdings(rank.rank, rank.generation, "jit", True, steps,
                                           steps, {2: steps}))
                rank.state = "ready"
                await rank.heartbeat()
            c.on_stop["localhost"] = holds_rank_2s_copy
            await c.started()
            await c.train(["localhost", "a1", "a2"], 3)
            await c.crash("a1")
            await c.crash("a2")
            assert await asyncio.wait_for(asyncio.shield(c.job), 5) == 75  # requeued: "retry"
            assert sorted(e["node"] for e in c.events("fault.fenced")) == ["a1", "a2"]
            [failed] = c.events("recovery.failed")
            assert failed["error"].startswith("no step is held for every rank: at step 3")
            assert "rank(s) [1]" in failed["error"]
            [ev] = c.events("escalate.requeue")
            assert ev["cause"] == "infrastructure"
            assert ["scontrol", "requeue", str(JOB)] in c.runner.argvs
            assert c.events("job.failed") == [] and c.events("recovery.assign") == []
            assert c.rank("s1").assigns == c.rank("s2").assigns == []
    run(scenario)


def _fails_with(error: str):
    """A rank whose step raises `error` (or that a STOP finds so): Holdings, then ready."""
    async def fails_again(rank: FakeRank, stop: P.Stop | None = None) -> None:
        await rank.send(P.Holdings(rank.rank, rank.generation, "jit", False, rank.own,
                                   [], {}, error=error))
        rank.state = "ready"
        await rank.heartbeat()
    return fails_again


fails_again = _fails_with("RuntimeError: boom")  # the script's own error


def test_a_rank_that_says_the_script_raised_ends_the_job_at_once_and_fences_nobody(tmp_path):
    """A TypeError in the script's step (an error it would raise on any node): the rank says
    so in its Goodbye before it exits, and the job fails as the script's error right away.
    Its connection ending and its step exiting 1 that follow are no fault: no node is fenced
    or replaced, no round is run, nothing is requeued."""
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 3)
            a1 = c.rank("a1")
            await a1.send(P.Goodbye(P.SCRIPT_ERROR + "TypeError: 'NoneType' object is not "
                                                     "callable"))
            await c.until(lambda: a1.goodbyes, "the controller's answer")  # as a rank waits
            await c.crash("a1", rc=1, dead=False, stderr="TypeError: 'NoneType' ...")
            assert await asyncio.wait_for(asyncio.shield(c.job), 5) == 1
            [failed] = c.events("job.failed")
            assert failed["cause"] == "script"
            assert failed["reason"] == ("rank 1 on a1 raised: TypeError: 'NoneType' object is "
                                        "not callable")
            assert c.events("fault.detected") == [] and c.events("fault.fenced") == []
            assert c.events("recovery.assign") == [] and c.rank("s1").assigns == []
            assert not any(argv[:2] == ["scontrol", "requeue"] for argv in c.runner.argvs)
    run(scenario)


def test_restarts_in_place_that_make_no_progress_end_the_job_as_the_scripts_error(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1,
                               max_stalled_restarts=2) as c:
            c.on_stop["a1"] = fails_again
            await c.started()
            await c.train(["localhost", "a1"], 3)
            for generation in (1, 2):
                await fails_again(c.rank("a1"))  # its step raises: ready, nobody stopped it
                a = await c.assigned("a1", generation)
                assert (a.restore_step, a.members) == (3, ["localhost", "a1"])
            await fails_again(c.rank("a1"))  # a third time at the same step: no progress
            assert await asyncio.wait_for(asyncio.shield(c.job), 5) == 1
            assert [e["nodes"] for e in c.events("fault.in_process")] == [["a1"]] * 3
            [failed] = c.events("job.failed")
            assert failed["cause"] == "script"
            assert failed["reason"] == ("2 restarts in place made no progress past step 3: "
                                        "RuntimeError: boom")
            assert c.events("escalate.requeue") == [] and c.events("escalate.fail") == []
            assert not any(argv[:2] == ["scontrol", "requeue"] for argv in c.runner.argvs)
            assert [e["generation"] for e in c.events("generation.start")] == [0, 1, 2]
            assert c.events("fault.fenced") == [] and c.rank("s1").assigns == []
            # One fault per fault, in the comment as in `status`: the step that raised again
            # and again before any restart's first step was done is one script error, not one
            # per retry; the ranks' goodbyes after job.failed are none
            assert [e for e in c.events("fault.detected") if e["t"] > failed["t"]] == []
            await c.until(lambda: c.comments, "the comment")
            st = build_status(load_run(tmp_path / "run"), time.time())
            assert [f.reason for f in st.faults] == ["rank reported a fault"]
            assert c.comments[-1].startswith("hpct: 1 fault(s), 0 move(s)"), c.comments
            # the node that raised trained on in place: no node lost, each in one list
            assert not [r for r in st.ranks if r.state == "lost"]
            assert not set(st.members) & set(st.spares)
    run(scenario)


def test_a_formation_broken_from_outside_is_named_and_requeued_not_the_scripts(tmp_path):
    """Issue 45: a stranger claiming a rank's gloo pairs breaks every formation with all
    members alive; the ranks report only gloo's errors. Each round says so
    (`formation.broken`), and at the limit the job is requeued as an infrastructure failure,
    never failed as the script's own error."""
    gloo = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
            "Timed out waiting 10000ms for recv operation to complete")

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1,
                               max_stalled_restarts=2) as c:
            fails_again = c.on_stop["a1"] = _fails_with(gloo)
            await c.started()
            await c.train(["localhost", "a1"], 3)
            for generation in (1, 2):
                await fails_again(c.rank("a1"))
                await c.assigned("a1", generation)
            await fails_again(c.rank("a1"))
            await asyncio.wait_for(asyncio.shield(c.job), 10)
            broken = c.events("formation.broken")
            assert [(e["stalled_restarts"], e["escalates"]) for e in broken] == [
                (0, False), (1, False), (2, True)]
            assert all(e["errors"] == [gloo] for e in broken)
            assert c.events("job.failed") == []
            [requeue] = c.events("escalate.requeue")
            assert requeue["cause"] == "infrastructure"
            assert requeue["reason"].startswith("formation broken by something other than a "
                                                "member: 2 restarts in place")
            assert ["scontrol", "requeue", str(JOB)] in c.runner.argvs
            # and the controller raised its descriptor limit at start (fdlimit.py)
            [start] = c.events("controller.start")
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            assert start["fd_limit"]["soft"] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            assert start["fd_limit"]["hard"] == hard
    run(scenario)


@pytest.mark.parametrize("dies", ["s1", "a2"])
def test_a_node_lost_while_the_new_generation_restores_costs_one_more_generation(tmp_path,
                                                                                 dies):
    """Issue 15, item 4: the spare that took the lost rank dies while it restores (`s1`), or
    a survivor it pulls from dies mid-transfer (`a2`): the next round takes the last spare at
    the same restore step (nothing rolled back, nothing escalated)."""
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1", "s2"], spares=2) as c:
            await c.started()
            await c.train(["localhost", "a1", "a2"], 3)
            await c.crash("a1")
            s1 = await c.assigned("s1", 1)
            assert (s1.rank, s1.restore_step) == (1, 3)

            async def pull_cut_short(rank, stop):  # s1 had not restored step 3 yet
                rank.own = []
                await rank.ready()
            c.rank("s1").on_stop = pull_cut_short
            await c.crash(dies)  # before the new group's first step

            s2 = await c.assigned("s2", 2)
            assert s2.restore_step == 3
            lost_rank = 1 if dies == "s1" else 2
            assert s2.rank == lost_rank
            members = ["localhost", "s2", "a2"] if dies == "s1" else ["localhost", "s1", "s2"]
            assert s2.members == members
            assigns = c.events("recovery.assign")
            assert [(e["generation"], e["restore_step"]) for e in assigns] == [(1, 3), (2, 3)]
            assert assigns[1]["taken"] == {dies: "s2"}
            assert c.events("recovery.failed") == [] and c.events("escalate.requeue") == []
            # the round's sources are the live survivors that hold the restore step: not s1,
            # which took a position in the round cut short and never restored it
            # (controller.py: asking it would cost the new spare a refused request)
            assert set(s2.sources) == ({0, 2} if dies == "s1" else {0})
            # the round's sources are the live survivors only
            assert all(int(r) != lost_rank or src == "peer"
                       for r, src in assigns[1]["sources"].items())

            await c.train(members, 4)
            assert await c.finish() == 0
            assert c.ctl.world.generation == 2
    run(scenario)


def test_move_requests_are_read_without_blocking_or_following_links(tmp_path):
    """Issue 30, section 3: `requests/` is read in the controller's loop. A fifo there froze
    the loop (a blocking open and read), a symlink was followed. Only regular files of at most
    REQUEST_MAX_BYTES are read; anything else is refused unread, said once
    (move.request_refused), and removed (a link as the link it is)."""
    import threading
    from types import SimpleNamespace

    from hpct_slurm.controller.lifecycle import Lifecycle
    from hpct_slurm.move_requests import REQUEST_MAX_BYTES
    from hpct_slurm.events import EventLog

    run_dir = tmp_path / "run"
    d = run_dir / "requests"
    d.mkdir(parents=True, mode=0o700)
    os.mkfifo(d / "move-n9")  # nobody ever writes to it
    target = tmp_path / "elsewhere"
    target.write_text("swap the NIC")
    os.symlink(target, d / "move-n8")
    (d / "move-n7").write_bytes(b"x" * (REQUEST_MAX_BYTES + 1))
    (d / "move-n6").mkdir()
    (d / "move-n5").write_text("not a member")
    ctl = SimpleNamespace(run_dir=run_dir, world=SimpleNamespace(members=["n1"]),
                          events=EventLog(path=tmp_path / "events.jsonl"))
    life = Lifecycle(ctl)
    t = threading.Thread(target=lambda: [life._user_requests() for _ in range(2)], daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading requests/ blocked the controller's loop"
    events = list(read_events(tmp_path / "events.jsonl"))
    refused = {e["file"]: e["why"] for e in events if e["event"] == "move.request_refused"}
    assert refused == {
        "move-n9": "request move-n9 is not a regular file (a fifo)",
        "move-n8": "request move-n8 is a symlink (never followed)",
        "move-n7": f"request move-n7 holds {REQUEST_MAX_BYTES + 1} bytes, more than the "
                   f"{REQUEST_MAX_BYTES} a request may",
        "move-n6": "request move-n6 is not a regular file (a directory)"}
    assert len([e for e in events if e["event"] == "move.request_refused"]) == 4  # once each
    [skipped] = [e for e in events if e["event"] == "move.skipped"]
    assert skipped["node"] == "n5" and "not an active member" in skipped["why"]
    assert sorted(p.name for p in d.iterdir()) == ["move-n6"]  # a directory stays
    assert target.read_text() == "swap the NIC"
