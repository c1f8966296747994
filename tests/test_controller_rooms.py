"""The controller's pieces alone (issue 28): what a registered rank may say
(controller/connections.py's checks, no socket), and the recovery round's phases
(controller/recovery_round.py) driven by a host whose ranks, fencing and Slurm are in-process
fakes: no Controller, no loopback, no Slurm. The Controller as a whole runs in
tests/test_controller_fast.py."""
from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Callable

import pytest

import hpct_slurm.controller
from hpct_slurm import protocol as P
from hpct_slurm.controller.connections import (STALE, Conn, Connections, check_register,
                                               check_relay_hello, refusal)
from hpct_slurm.controller.detection import IN_PROCESS
from hpct_slurm.controller.ending import ScriptError
from hpct_slurm.controller.options import Options
from hpct_slurm.controller.policy import Held, RecoveryRecord, World, initial_shards
from hpct_slurm.controller.recovery_round import RecoveryRound
from hpct_slurm.errors import HpctError
from hpct_slurm.events import Ev, RankState

JOB = "7"
PACKAGE = Path(hpct_slurm.controller.__file__).parent


def conn(node: str = "n1", local_rank: int = 0, rank: int = 0, generation: int = 1) -> Conn:
    c = Conn(node, local_rank, "active", 100, "10.0.0.1", 4000, None, None)  # type: ignore[arg-type]
    c.rank, c.generation = rank, generation
    return c


# ---- what a registered rank may say --------------------------------------------------------------

def test_a_current_heartbeat_counts_and_a_stale_one_is_dropped_quietly():
    c = conn(rank=3, generation=2)
    assert refusal(c, P.Heartbeat(3, 2, 10, "running")) is None
    assert refusal(c, P.Heartbeat(3, 1, 10, "running")) == STALE  # its last generation
    assert refusal(c, P.Goodbye("done")) is None  # only heartbeats and StepDones are checked


@pytest.mark.parametrize("msg, field, words", [
    (P.Heartbeat(3, 2, 10, "dancing"), "state", "is not one of"),
    (P.Heartbeat(3, 2, -2, "running"), "step", "-2 is below -1"),
    (P.Heartbeat(3, 5, 10, "running"), "generation", "5 was never assigned to this rank"),
    (P.Heartbeat(3, -2, 10, "running"), "generation", "was never assigned"),
    (P.Heartbeat(4, 2, 10, "running"), "rank", "4 is not this connection's rank (3)"),
    (P.StepDone(4, 2, 10), "rank", "4 is not this connection's rank"),
    (P.StepDone(3, 2, -1), "step", "-1 does not follow step"),
])
def test_a_message_that_contradicts_the_assignment_is_refused_naming_the_field(msg, field, words):
    name, why = refusal(conn(rank=3, generation=2), msg)
    assert name == field and words in why


def test_steps_only_go_forward_within_a_generation_and_not_before_an_assignment():
    c = conn(rank=3, generation=2)
    c.done_generation, c.done_step = 2, 10
    assert refusal(c, P.StepDone(3, 2, 10)) == ("step", "10 does not follow step 10 of "
                                                        "generation 2")
    assert refusal(c, P.StepDone(3, 2, 11)) is None
    fresh = conn(rank=-1, generation=-1)
    assert refusal(fresh, P.StepDone(-1, -1, 0)) == ("generation", "before any assignment")


def register(**over) -> P.Register:
    fields = dict(job_id=JOB, node="n1", local_rank=1, role="active", pid=42,
                  host_addr="10.0.0.1", transfer_port=4000)
    fields.update(over)
    return P.Register(**fields)  # type: ignore[arg-type]


def test_a_register_that_fits_the_job_passes():
    check_register(register(), JOB, 2, ["n1", "n2"])
    check_register(register(node="s1", role="spare"), JOB, 2, ["n1", "n2"])


@pytest.mark.parametrize("over, words", [
    (dict(job_id="8"), "register.job_id '8' is not this job (7)"),
    (dict(local_rank=2), "register.local_rank 2 is outside 0..1 (2 tasks per node)"),
    (dict(pid=0), "register.pid 0 is not a process id"),
    (dict(transfer_port=65536), "register.transfer_port 65536 is not a TCP port"),
    (dict(host_addr="evil host"), "register.host_addr 'evil host' is not an address"),
    (dict(node="s1"), "register.role 'active' from s1, which is not an active member"),
])
def test_a_register_is_refused_naming_the_field_it_gets_wrong(over, words):
    with pytest.raises(P.ProtocolError) as err:
        check_register(register(**over), JOB, 2, ["n1", "n2"])
    assert err.value.message.startswith(words)


def test_a_relay_hello_must_be_this_jobs_and_name_a_process():
    check_relay_hello(P.RelayHello(JOB, "n1", "active", 9), JOB)
    with pytest.raises(P.ProtocolError, match="relay_hello.job_id '8' is not this job"):
        check_relay_hello(P.RelayHello("8", "n1", "active", 9), JOB)
    with pytest.raises(P.ProtocolError, match="relay_hello.pid -1 is not a process id"):
        check_relay_hello(P.RelayHello(JOB, "n1", "active", -1), JOB)


# ---- the recovery round, with everything around it faked -----------------------------------------

class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def emit(self, event, **fields) -> dict:
        self.seen.append((str(event), fields))
        return fields

    def named(self, event: Ev) -> list[dict]:
        return [f for e, f in self.seen if e == str(event)]


class RoundHost(RecoveryRound, Connections):
    """A recovery round's host: the real round (and the real `_live`, a lookup), with fake
    ranks that answer a STOP as `answers(conn)` says (True: Holdings of step 5 and ready),
    fencing that only marks the node's ranks gone, and a log of what went where, in order."""

    def __init__(self, run_dir: Path, members: list[str], spares: list[str],
                 answers: Callable[[Conn], bool] = lambda c: True, on_no_spare: str = "requeue"):
        self.o = Options(command=["train"], run_dir=run_dir, job_id=int(JOB),
                         nodes=members + spares, batch_host=members[0], on_no_spare=on_no_spare,
                         ready_timeout_s=0.3)
        self.run_dir, self.secret, self.events = run_dir, b"secret", Events()
        self.world = World(list(members), list(spares), 1)
        self.shards, self.data_world = initial_shards(members), len(members)
        self.conns: dict[tuple[str, int], Conn] = {}
        self.dead_nodes: set[str] = set()
        self.pending_faults: dict[str, str] = {}
        self.recovering, self.recovery, self.stalled_restarts = True, None, 0
        self.gen0_scheduled = True  # a job that started: its members hold generation 0
        self.first_step_reports: dict[int, int] = {}
        self.said_done: set[int] = set()
        self.answers = answers
        self.log: list[tuple] = []
        # nothing on its way but what a test puts there (arrivals.py)
        self.fencing: dict = {}
        self.borrowed: list[int] = []
        self.pool_nodes: set[str] = set()
        self.spare_wait_s = 1.0
        for i, node in enumerate(members + spares):
            c = Conn(node, 0, "active" if node in members else "spare", 100 + i,
                     f"10.0.0.{i + 1}", 4000, None, None)  # type: ignore[arg-type]
            if node in members:
                c.rank, c.generation, c.state, c.step = i, 0, RankState.RUNNING, 5
                c.done_generation, c.done_step = 0, 5
            self.conns[(node, 0)] = c

    async def _send(self, c: Conn, msg) -> None:
        if c.gone:
            return
        self.log.append((msg.TYPE, c.node))
        if isinstance(msg, P.Stop) and self.answers(c):
            c.held, c.held_rank = Held(frozenset({5})), c.rank
            c.state = RankState.READY
        if isinstance(msg, P.Assign):
            self.log[-1] += (msg.rank, msg.restore_step, msg.sources)

    async def _fence(self, node: str, reason: str) -> None:
        for c in self._live(node):
            c.gone = True
        self.dead_nodes.add(node)
        self.log.append(("fence", node))

    def _maybe_borrow(self) -> None:
        self.log.append(("borrow",))

    def lose(self, node: str, reason: str = "connection lost") -> None:
        self.conns[(node, 0)].gone = reason != IN_PROCESS
        self.pending_faults[node] = reason


def recover(host: RoundHost) -> None:
    asyncio.run(asyncio.wait_for(host._recover(), 5))


def test_a_round_stops_the_survivors_then_fences_then_gives_the_lost_position_to_a_spare(
        tmp_path):
    host = RoundHost(tmp_path, ["n1", "n2", "n3"], ["s1"])
    host.lose("n2")
    recover(host)
    assert host.log[:3] == [("stop", "n1"), ("stop", "n3"), ("fence", "n2")]
    assigns = {entry[1]: entry[2:] for entry in host.log if entry[0] == "assign"}
    # s1 takes n2's position and rank, and pulls step 5 from the survivors that hold it
    assert assigns == {"n1": (0, 5, {0: [("10.0.0.1", 4000)], 2: [("10.0.0.3", 4000)]}),
                       "s1": (1, 5, {0: [("10.0.0.1", 4000)], 2: [("10.0.0.3", 4000)]}),
                       "n3": (2, 5, {0: [("10.0.0.1", 4000)], 2: [("10.0.0.3", 4000)]})}
    assert host.log[-1] == ("borrow",)
    assert (host.world.members, host.world.spares, host.world.generation, host.world.lost) == \
        (["n1", "s1", "n3"], [], 1, ["n2"])
    assert host.recovery is not None and host.recovery.taken == {"n2": "s1"}
    assert host.recovery.reasons == {"n2": "connection lost"} and host.recovery.newest_done == 5
    [stop] = host.events.named(Ev.FAULT_STOP_SENT)
    assert stop == {"generation": 0, "survivors": 2}


def test_a_survivor_that_never_gets_ready_is_lost_in_the_same_round(tmp_path):
    host = RoundHost(tmp_path, ["n1", "n2", "n3"], ["s1", "s2"],
                     answers=lambda c: c.node != "n3")
    host.lose("n2")
    recover(host)
    assert [e for e in host.log if e[0] == "fence"] == [("fence", "n2"), ("fence", "n3")]
    [second] = host.events.named(Ev.FAULT_SECOND)
    assert second["nodes"] == ["n3"]
    assert host.world.generation == 1  # one round, not two
    assert host.world.members == ["n1", "s1", "s2"] and host.world.lost == ["n2", "n3"]
    assert host.recovery is not None and host.recovery.reasons["n3"].startswith(
        "not ready after fault")


def test_a_member_that_reported_its_own_fault_restarts_in_place(tmp_path):
    host = RoundHost(tmp_path, ["n1", "n2"], ["s1"])
    host.conns[("n2", 0)].state = RankState.READY
    host.lose("n2", IN_PROCESS)
    recover(host)
    assert not [e for e in host.log if e[0] == "fence"]
    assert ("stop", "n2") in host.log  # a survivor like every other
    assert host.world.members == ["n1", "n2"] and host.world.spares == ["s1"]
    assert host.world.generation == 1 and host.world.lost == []
    [inp] = host.events.named(Ev.FAULT_IN_PROCESS)
    assert inp["nodes"] == ["n2"]


def test_a_lost_spare_alone_is_fenced_and_nobody_stops(tmp_path):
    host = RoundHost(tmp_path, ["n1", "n2"], ["s1", "s2"])
    host.lose("s1")
    recover(host)
    assert host.log == [("fence", "s1")]
    assert host.world.spares == ["s2"] and host.world.generation == 0


@pytest.mark.parametrize("on_no_spare", ["requeue", "fail"])
def test_a_loss_beyond_the_spares_is_raised_for_the_round_loop_to_escalate(tmp_path,
                                                                          on_no_spare):
    host = RoundHost(tmp_path, ["n1", "n2"], [], on_no_spare=on_no_spare)
    host.lose("n2")
    with pytest.raises(HpctError) as err:
        recover(host)
    assert not isinstance(err.value, ScriptError)  # the infrastructure's, not the script's
    assert not [e for e in host.log if e[0] == "assign"]
    assert host.world.members == ["n1", "n2"] and host.world.generation == 0


def test_a_round_that_cuts_the_open_one_short_keeps_its_faults_in_the_record(tmp_path):
    """Issue 30, "Records": n0 was lost and n2 took its place, and before the new generation
    completed its first step n2 is lost too. The round's record holds both faults, each with
    its cause, from the first one's detection (recovery.done, the Slurm comment)."""
    host = RoundHost(tmp_path, ["n1", "n2", "n3"], ["s1"])
    host.recovery = RecoveryRecord(t_detect=1.0, generation=0, restore_step=5, lost=["n0"],
                                   taken={"n0": "n2"}, reasons={"n0": "connection lost"},
                                   newest_done=7)
    host.lose("n2", "step exited (1)")
    recover(host)
    rec = host.recovery
    assert rec is not None and rec.generation == 1
    assert rec.lost == ["n0", "n2"] and rec.taken == {"n0": "n2", "n2": "s1"}
    assert rec.reasons == {"n0": "connection lost", "n2": "step exited (1)"}
    assert (rec.t_detect, rec.newest_done) == (1.0, 7)


# ---- the pieces' imports -------------------------------------------------------------------------

def test_no_module_of_the_controller_package_imports_another_in_a_circle():
    """Also imports under TYPE_CHECKING: each piece must be readable without the others'."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    imports: dict[str, set[str]] = {}
    for p in PACKAGE.glob("*.py"):
        found = set()
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom) and n.level == 1:
                found |= {n.module.split(".")[0]} if n.module else {a.name for a in n.names}
        imports[p.stem] = found & modules
    assert imports["lifecycle"] and "controller" not in imports["lifecycle"]

    def circle(path: list[str]) -> list[str] | None:
        for m in sorted(imports[path[-1]]):
            if m in path:
                return path + [m]
            found = circle(path + [m])
            if found:
                return found
        return None

    assert [c for m in sorted(modules) if (c := circle([m]))] == []


# ---- fencing -------------------------------------------------------------------------------------

class FenceHost:
    """Fencing (controller/fencing.py) with in-process fakes around it: a live node whose
    step cancel takes as long as scancel does against a stopped slurmstepd."""

    from hpct_slurm.controller.fencing import Fencing as _F
    _fence = _F._fence
    _cancel_then_spare = _F._cancel_then_spare

    def __init__(self, cancel_s: float):
        from test_hostile_network import Events

        self.o = Options(command=["true"], run_dir=Path("/nonexistent"), job_id=int(JOB),
                         nodes=["n1", "n2", "n3"], batch_host="n1")
        self.ev = Events()
        self.events = self.ev.log
        self.steps: dict = {}
        self.dead_nodes: set[str] = set()
        self.expected_exits: set[int] = set()
        self.fencing: dict = {}
        self.pool_nodes: set[str] = set()
        self.finished = asyncio.Event()
        self.cancel_s, self.cancelled, self.replenished = cancel_s, [], []
        self.slurm = None

    def _live(self, node):
        return []

    def _slurmd_reachable(self, node):
        return True

    def _usable_in_slurm(self, node):
        return True

    def _cancel_steps_on(self, node):
        import time
        time.sleep(self.cancel_s)
        self.cancelled.append(node)

    def _steps_left_on(self, node):
        return [] if node in self.cancelled else ["7"]

    def _replenish(self, node):
        self.replenished.append((node, list(self.cancelled)))


def test_fencing_a_stopped_step_does_not_hold_the_round_up():
    """Issue 30.2: scancel of a step whose slurmstepd is SIGSTOPped waits out slurmd's
    MessageTimeout (10 s here, 1.5 s in this fake); the round waited with it. Now the round
    goes on at once; the node comes back as a spare only after its step is gone."""
    host = FenceHost(cancel_s=1.5)

    async def scenario():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await host._fence("n3", "no heartbeat for 3.0 s")
        fenced_after = loop.time() - t0
        assert host.ev.named("fault.fenced")[0]["how"] == "step cancelled"
        assert host.cancelled == [] and "n3" in host.fencing  # still under way
        await host.fencing["n3"]
        await asyncio.sleep(1.1)  # the spare comes back a second after the cancel
        return fenced_after

    fenced_after = asyncio.run(scenario())
    assert fenced_after < 0.5
    assert host.cancelled == ["n3"] and host.fencing == {}
    assert host.replenished == [("n3", ["n3"])]  # never before its step was gone
