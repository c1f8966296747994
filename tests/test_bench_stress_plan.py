"""`bench stress`'s awkward moments (issue 19) without a cluster: the seeded plan with the
formation, owner + holder and taker kinds and its spare budget, the injector's event-timed
kills against a controller log written as it goes, and the per-fault outcome (disk fallback,
recomputed steps, the longest pause while a warm spare was ready)."""
from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest

from hpct_slurm.bench import stress as S
from hpct_slurm.errors import HpctError
from hpct_slurm.events import read_events
from hpct_slurm.recovery.ring import replica_peer


@pytest.mark.parametrize("cfg", [S.FULL, S.QUICK], ids=["full", "quick"])
def test_plan_holds_the_awkward_kinds_seeded(cfg):
    a = S.plan(cfg)
    assert a == S.plan(cfg)
    kinds = [f.kind for f in a]
    assert kinds.count("formation") == cfg.formations >= 1
    assert kinds.count("owner_and_holder") == cfg.owner_holders >= 1
    assert kinds.count("taker") == cfg.takers >= 1
    assert sum(f.size for f in a) == cfg.faults
    # the first formation is at generation 0, the only fault there
    assert a[0].kind == "formation" and a[0].at_start and a[0].size == 1
    assert not any(f.at_start for f in a[1:])
    assert all(0 <= f.index < S.ACTIVE for f in a if f.kind in S.AIMED)
    assert all(f.index == -1 for f in a if f.kind not in S.AIMED)
    other = S.plan(S.Config(**{**cfg.__dict__, "seed": cfg.seed + 1}))
    assert [(f.kind, f.index, f.gap_steps) for f in other] != \
        [(f.kind, f.index, f.gap_steps) for f in a]


def test_plan_never_asks_for_more_spares_than_exist():
    for seed in range(200):
        for active, nodes in ((3, 5), (4, 6), (2, 4)):
            cfg = S.Config(**{**S.FULL.__dict__, "seed": seed})
            faults = S.plan(cfg, active, nodes)
            budget = S.spare_budget(faults, active, nodes)
            assert all(f.spares <= have for f, have in zip(faults, budget)), (seed, faults)
            crash = [f.kind for f in faults].index("node_crash")
            assert not [f for f in faults[crash:] if f.spares > 1]
            assert all(f.index < active for f in faults)


def test_spare_budget_and_sizes():
    faults = [S.Fault("formation", 3, 0, at_start=True), S.Fault("taker", 3, 1),
              S.Fault("node_crash", 3), S.Fault("kill_rank", 3), S.Fault("formation", 3, 2)]
    assert [f.size for f in faults] == [1, 2, 1, 1, 2]
    assert [f.spares for f in faults] == [1, 2, 1, 1, 2]
    assert S.spare_budget(faults, 3, 5) == [2, 2, 2, 1, 1]
    with pytest.raises(HpctError, match=r"fault 4 \(formation\) needs 2 warm spare\(s\)"):
        S.check_plan(faults, 3, 5)
    S.check_plan(faults[:4], 3, 5)
    with pytest.raises(HpctError, match="must be the first formation"):
        S.check_plan([S.Fault("kill_rank", 3), S.Fault("formation", 3, 0, at_start=True)], 3, 5)
    with pytest.raises(HpctError, match="outside 0..2"):
        S.check_plan([S.Fault("taker", 3, 3)], 3, 5)


def test_plan_refuses_a_shape_with_too_few_spares():
    """One spare: a replacement for two losses is impossible, so the plan says so up front
    instead of running into an escalation."""
    with pytest.raises(HpctError, match=r"needs 2 warm spare\(s\) but the 4-node job"):
        S.plan(S.QUICK, active=3, nodes=4)
    one = S.Config(faults=3, steps=100, step_sleep=0, back_to_back=0, node_crashes=0,
                   kill_spares=0, hangs=1, formations=1)
    kinds = [f.kind for f in S.plan(one, 3, 4)]
    assert kinds[0] == "formation" and sorted(kinds[1:]) == ["hang_rank", "kill_rank"]
    with pytest.raises(HpctError, match="fewer than the special faults"):
        S.plan(S.Config(faults=3, steps=10, step_sleep=0, back_to_back=0, node_crashes=0,
                        kill_spares=0, hangs=0, takers=2))


def _injector(tmp_path: Path, batch_host: str = "n1") -> S._Injector:
    return S._Injector(None, tmp_path, batch_host, random.Random(1))  # type: ignore[arg-type]


def test_aim_takes_the_replica_holder_from_the_ring():
    inj = _injector(Path("/nonexistent"))
    members = ["n1", "n2", "n3", "n4"]
    assert inj._aim(1, members, False, with_holder=True) == 1
    assert members[replica_peer(1, 4)] == "n4"
    # n1 spared: position 3's holder is n2 (half the ring away), position 2's is n1
    assert inj._aim(2, members, True, with_holder=True) == 3
    assert inj._aim(0, members, True) == 1
    with pytest.raises(HpctError, match="no position"):
        inj._aim(0, ["n1"], True)


class _Controller:
    """A controller log written line by line, as the real one is."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    def emit(self, event: str, **fields) -> dict:
        e = {"t": time.time(), "event": event, **fields}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(e) + "\n")
        return e

    def later(self, delay: float, event: str, after: list, **fields) -> threading.Thread:
        """Emit `event` `delay` s after the first signal is in `after` (the injector's kill:
        what the controller answers; the injector reads where the log ends before it kills)."""
        th = threading.Thread(target=lambda: (_first(after), time.sleep(delay),
                                              self.emit(event, **fields)))
        th.start()
        return th


def _first(sent: list, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not sent and time.monotonic() < deadline:
        time.sleep(0.005)


def _start(ctl: _Controller) -> S.JobView:
    ctl.emit("controller.start", active=["n1", "n2", "n3"], spares=["n4", "n5"])
    for i, n in enumerate(["n1", "n2", "n3", "n4", "n5"]):
        ctl.emit("rank.register", node=n, local_rank=0, pid=100 + i,
                 role="spare" if n in ("n4", "n5") else "active")
    ctl.emit("generation.start", generation=0, members=["n1", "n2", "n3"], restore_step=-1)
    return S.view(read_events(ctl.path))


@pytest.fixture
def killed(monkeypatch):
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(S.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def test_taker_is_killed_right_after_its_assignment(tmp_path, killed):
    ctl = _Controller(tmp_path / "controller.jsonl")
    v = _start(ctl)
    assert v.generation == 0
    th = ctl.later(0.3, "recovery.assign", after=killed, generation=1, restore_step=8,
                   taken={"n2": "n5"}, members=["n1", "n5", "n3"])
    rec = _injector(tmp_path).inject(S.Fault("taker", 3, 1), v, False)
    th.join()
    assert [k["node"] for k in rec["kills"]] == ["n2", "n5"] == rec["targets"]
    assert [k["role"] for k in rec["kills"]] == ["trigger", "taker"]
    assert [pid for pid, _ in killed] == [101, 104]
    assert rec["waited_for"]["event"] == "recovery.assign"
    assert rec["waited_for"]["generation"] == 1
    assert 0 <= rec["delay_s"] < 0.5 and rec["window_s"] == 0.05
    assert rec["in_window"] == (rec["delay_s"] <= 0.05)


def test_formation_kill_waits_for_the_next_generation(tmp_path, killed):
    ctl = _Controller(tmp_path / "controller.jsonl")
    v = _start(ctl)
    inj = _injector(tmp_path)
    th = threading.Thread(target=lambda: (
        _first(killed), time.sleep(0.2),  # the controller answers the trigger's kill
        ctl.emit("generation.start", generation=0, members=["n1", "n2", "n3"]),  # stale
        ctl.emit("recovery.assign", generation=1, taken={"n3": "n4"},
                 members=["n1", "n2", "n4"]),
        ctl.emit("generation.start", generation=1, members=["n1", "n2", "n4"])))
    th.start()
    rec = inj.inject(S.Fault("formation", 3, 2), v, False)
    th.join()
    assert rec["waited_for"]["event"] == "generation.start"
    assert rec["waited_for"]["generation"] == 1
    assert rec["kills"][-1]["node"] == "n4" and rec["kills"][-1]["role"] == "formation"
    assert killed[-1][0] == 103  # the taker's process: it registered as a spare
    assert rec["delay_s"] is not None and rec["delay_s"] >= 0


def test_formation_at_generation_zero_and_skipped_without_a_spare(tmp_path, killed,
                                                                  monkeypatch):
    ctl = _Controller(tmp_path / "controller.jsonl")
    _start(ctl)
    inj = _injector(tmp_path)
    monkeypatch.setattr(inj, "job_queued", lambda: True)
    rec = inj.at_start(S.Fault("formation", 3, 1, at_start=True), False)
    assert rec["targets"] == ["n2"] and killed == [(101, S.signal.SIGKILL)]
    assert rec["waited_for"]["generation"] == 0 and rec["skipped"] is None

    bare = _Controller(tmp_path / "bare" / "controller.jsonl")
    bare.emit("controller.start", active=["n1", "n2", "n3"], spares=["n4", "n5"])
    for i, n in enumerate(["n1", "n2", "n3"]):
        bare.emit("rank.register", node=n, local_rank=0, pid=100 + i, role="active")
    bare.emit("generation.start", generation=0, members=["n1", "n2", "n3"])
    inj = _injector(tmp_path / "bare")
    monkeypatch.setattr(inj, "job_queued", lambda: True)
    rec = inj.at_start(S.Fault("formation", 3, 1, at_start=True), False)
    assert rec["skipped"] and not rec["kills"] and len(killed) == 1


def test_owner_and_holder_kills_the_replica_holder(tmp_path, killed):
    ctl = _Controller(tmp_path / "controller.jsonl")
    v = _start(ctl)
    rec = _injector(tmp_path).inject(S.Fault("owner_and_holder", 3, 2), v, False)
    assert rec["targets"] == ["n3", "n1"]  # replica_peer(2, 3) == 0
    assert rec["waited_for"] is None and rec["delay_s"] is None
    assert [pid for pid, _ in killed] == [102, 100]


def test_tail_reads_only_whole_lines_and_times_out(tmp_path):
    path = tmp_path / "controller.jsonl"
    tail = S._Tail(path)
    assert tail.read() == []
    path.write_text('{"t": 1, "event": "a"}\n{"t": 2, "ev')
    assert [e["event"] for e in tail.read()] == ["a"]
    with open(path, "a") as f:
        f.write('ent": "b"}\n')
    assert [e["event"] for e in tail.read()] == ["a", "b"]
    assert tail.when("b", lambda e: e["event"] == "b")["t"] == 2
    with pytest.raises(HpctError, match="never saw c"):
        tail.when("c", lambda e: e["event"] == "c", timeout=0.05)
    with pytest.raises(HpctError, match="the job ended before c"):
        tail.when("c", lambda e: e["event"] == "c", timeout=5, alive=lambda: False)
    tail.close()


def _steps(times_by_step: dict[int, list[float]], ranks=(0, 1, 2)) -> list[dict]:
    return [{"event": "rank.step", "rank": r, "step": s, "t": t}
            for s, ts in times_by_step.items() for t in ts for r in ranks]


def test_fault_outcomes_disk_fallback_recomputed_and_pause():
    """owner_and_holder at t=10 after step 14: the group falls back to disk step 10 and
    recomputes 11..14 on every rank (12 steps), recovers at 12.0; the taker fault at t=20 is a
    clean one; a spare kill is fenced; a skipped formation stays skipped."""
    ctl = [{"event": "controller.start", "t": 0.0, "active": ["n1", "n2", "n3"]},
           {"event": "rank.register", "t": 0.5, "node": "n4", "role": "spare", "pid": 4},
           {"event": "rank.register", "t": 0.5, "node": "n5", "role": "spare", "pid": 5},
           {"event": "generation.start", "t": 1.0, "generation": 0},
           {"event": "fault.detected", "t": 10.1, "node": "n2", "role": "active",
            "reason": "connection lost"},
           {"event": "fault.detected", "t": 10.1, "node": "n3", "role": "active",
            "reason": "connection lost"},
           {"event": "recovery.assign", "t": 10.5, "generation": 1,
            "members": ["n1", "n4", "n5"], "taken": {"n2": "n4", "n3": "n5"}},
           {"event": "recovery.disk_fallback", "t": 10.5, "generation": 1,
            "restore_step": 10, "newest_held": 14},
           {"event": "recovery.done", "t": 12.0, "recovery_s": 1.9},
           {"event": "rank.register", "t": 15.0, "node": "n2", "role": "spare", "pid": 22},
           {"event": "rank.register", "t": 15.0, "node": "n3", "role": "spare", "pid": 23},
           {"event": "fault.detected", "t": 20.1, "node": "n1", "role": "active",
            "reason": "connection lost"},
           {"event": "recovery.assign", "t": 20.3, "generation": 2,
            "members": ["n2", "n4", "n5"], "taken": {"n1": "n2"}},
           {"event": "fault.detected", "t": 20.35, "node": "n2", "role": "active",
            "reason": "connection lost"},
           {"event": "recovery.assign", "t": 20.8, "generation": 3,
            "members": ["n3", "n4", "n5"], "taken": {"n1": "n3"}},
           {"event": "recovery.done", "t": 21.5, "recovery_s": 1.4},
           {"event": "rank.register", "t": 25.0, "node": "n1", "role": "spare", "pid": 31},
           {"event": "fault.detected", "t": 30.1, "node": "n1", "role": "spare",
            "reason": "step exited"},
           {"event": "fault.fenced", "t": 30.2, "node": "n1"},
           {"event": "job.done", "t": 40.0}]
    steps = {s: [1.5 + 0.5 * s] for s in range(15)}  # 0..14 by t=8.5
    for s in range(11, 15):
        steps[s].append(12.0 + 0.1 * (s - 11))  # recomputed after the fallback
    for s in range(15, 80):  # on until the next fault, and after its recovery
        steps[s] = [12.5 + (s - 15) * 0.2 if s < 50 else 21.5 + (s - 50) * 0.3]
    step_evs = _steps(steps)
    records = [
        {"kind": "formation", "skipped": "no warm spare", "kills": [], "targets": []},
        {"kind": "owner_and_holder", "t": 10.0, "skipped": None, "targets": ["n2", "n3"],
         "kills": [{"node": "n2", "t": 10.0}, {"node": "n3", "t": 10.0}]},
        {"kind": "taker", "t": 20.0, "skipped": None, "targets": ["n1", "n2"],
         "in_window": True,
         "kills": [{"node": "n1", "t": 20.0}, {"node": "n2", "t": 20.32}]},
        {"kind": "kill_spare", "t": 30.0, "skipped": None, "targets": ["n1"],
         "kills": [{"node": "n1", "t": 30.0}]},
    ]
    out = S.fault_outcomes(ctl, records, step_evs, end_t=41.0)
    skipped, oh, taker, spare = out
    assert skipped["recovered"] is None
    assert oh["recovered"] and oh["disk_fallback"] and oh["disk_fallback_restore_step"] == 10
    assert oh["recomputed_steps"] == 4 * 3
    assert oh["recovery_s"] == pytest.approx(2.0) and oh["controller_recovery_s"] == 1.9
    # no step from 8.5 (step 14) to 12.0, spares ready throughout
    assert oh["max_pause_with_spare_s"] == pytest.approx(3.5)
    assert taker["recovered"] and not taker["disk_fallback"] and taker["recomputed_steps"] == 0
    assert taker["recovery_s"] == pytest.approx(1.5)
    assert taker["detected"] == {"n1": "connection lost", "n2": "connection lost"}
    assert spare["recovered"] and spare["recovery_s"] == pytest.approx(0.2)

    counts = S.kind_counts(S.plan(S.QUICK), out)
    assert counts["formation"]["planned"] == 2 and counts["formation"]["skipped"] == 1
    assert counts["owner_and_holder"] == {
        "planned": 1, "injected": 1, "skipped": 0, "recovered": 1, "disk_fallback": 1,
        "recomputed_steps": 12, "max_pause_with_spare_s": pytest.approx(3.5)}
    assert counts["taker"]["in_window"] == 1
    assert "back_to_back" not in counts


def test_an_escalation_is_not_a_recovery():
    ctl = [{"event": "generation.start", "t": 1.0, "generation": 0},
           {"event": "fault.detected", "t": 5.1, "node": "n2", "role": "active",
            "reason": "x"},
           {"event": "escalate.requeue", "t": 8.0, "reason": "no spare"},
           {"event": "recovery.done", "t": 30.0, "recovery_s": 1.0}]
    out = S.fault_outcomes(ctl, [{"kind": "kill_rank", "t": 5.0, "skipped": None,
                                  "kills": [{"node": "n2", "t": 5.0}], "targets": ["n2"]}],
                           [], end_t=31.0)
    assert out[0]["recovered"] is False and out[0]["escalated"] == ["escalate.requeue"]
    undetected = S.fault_outcomes(ctl, [{"kind": "kill_rank", "t": 9.0, "skipped": None,
                                         "kills": [{"node": "n3", "t": 9.0}]}], [], 31.0)
    assert undetected[0]["recovered"] is False and undetected[0]["detected"] == {"n3": None}


def test_pause_counts_only_from_when_a_spare_was_ready():
    ctl = [{"event": "controller.start", "t": 0.0, "active": ["n1", "n2"]},
           {"event": "generation.start", "t": 1.0, "generation": 0},
           {"event": "rank.register", "t": 6.0, "node": "n3", "role": "spare", "pid": 3},
           {"event": "recovery.assign", "t": 9.0, "members": ["n1", "n3"]},
           {"event": "rank.register", "t": 30.0, "node": "n2", "role": "spare", "pid": 2},
           {"event": "step.launch", "t": 50.0, "node": "n2", "role": "spare"}]
    # steps at 2 and 20: a spare from 6 to 9 only; then 20 -> 45 with a spare from 30
    pauses = S.pauses_with_spare(ctl, [2.0, 20.0, 45.0, 60.0], end_t=70.0)
    assert [(a, b) for a, b, _ in pauses] == [(1.0, 2.0), (2.0, 20.0), (20.0, 45.0),
                                              (45.0, 60.0), (60.0, 70.0)]
    # (45, 60): a spare was ready when it began (relaunched at 50): all of it counts
    assert [p for _, _, p in pauses] == [0.0, 14.0, 15.0, 15.0, 0.0]
    assert S.spare_timeline(ctl) == [(0.0, 0), (6.0, 1), (9.0, 0), (30.0, 1), (50.0, 0)]
    assert S.pauses_with_spare([], [1.0], 2.0) == []


def test_recomputed_steps_go_to_the_fault_before_them():
    evs = [{"rank": 0, "step": 5, "t": 1.0}, {"rank": 0, "step": 5, "t": 11.0},
           {"rank": 1, "step": 5, "t": 1.0}, {"rank": 1, "step": 5, "t": 21.0},
           {"rank": 1, "step": 5, "t": 22.0}, {"rank": 2, "step": 7, "t": 0.5},
           {"rank": 2, "step": 7, "t": 0.6}]
    assert S.recomputed_by_fault(evs, [10.0, 20.0]) == [1, 2]  # the one before any: none


def test_latest_pid_and_view_generation():
    evs = [{"event": "rank.register", "node": "n2", "pid": 1, "role": "spare"},
           {"event": "generation.start", "generation": 3, "t": 0},
           {"event": "rank.register", "node": "n2", "pid": 7, "role": "spare"}]
    assert S.latest_pid(evs, "n2") == 7 and S.latest_pid(evs, "n9") is None
    assert S.view(evs).generation == 3


def test_second_fault_survivor_wait_is_from_the_last_stop_before_each_ready():
    """bench second_fault's survivor wait (pure): a survivor's ready report counts from the
    STOP just before it; the lost nodes' own reports are not survivors'."""
    from hpct_slurm.bench.second_fault import survivor_waits

    controller = [{"event": "fault.stop_sent", "t": 10.0}, {"event": "fault.stop_sent", "t": 12.0}]
    ranks = [{"event": "rank.ready", "t": 10.4, "source": "n1/0"},
             {"event": "rank.ready", "t": 13.5, "source": "n3/0"},  # after the second STOP
             {"event": "rank.ready", "t": 19.0, "source": "n4/0"},  # the dead taker's
             {"event": "rank.step", "t": 20.0, "source": "n1/0"}]
    assert survivor_waits(controller, ranks, {"n2", "n4"}) == 1.5
    assert survivor_waits(controller, ranks, {"n2"}) == 7.0
