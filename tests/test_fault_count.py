"""Issue 45.4 and 45.6: one fault per fault, in `status` and in the job's Slurm comment alike
(both apply fault_count.py's rule to the controller's records), and what `status` says of a
fault afterwards: a node fenced alive and back as a spare still says which rank it held, a
round folded into a later one is back with that one, nothing is "not back yet" once the job
has ended.

Pure tests on recorded event logs (tests/data/script-error-run: a job whose step raised on
rank 1 in every generation, recorded before this fix: its comment said "1 fault(s)" while
`status` listed the ranks' goodbyes as 3 more faults), and synthetic logs; the controller's count with its in-process fakes is in
test_controller_fast (test_restarts_in_place_that_make_no_progress_...)."""
from __future__ import annotations

import io
from pathlib import Path

from hpct_slurm.report.cli import format_status, load_run
from hpct_slurm.report.model import RunEvents, build_status

SCRIPT_ERROR = Path(__file__).parent / "data" / "script-error-run"


def _ev(t: float, event: str, **fields) -> dict:
    return {"t": t, "event": event, **fields}


def _count(records: list[dict]) -> int:
    from hpct_slurm.fault_count import FaultCount

    c = FaultCount()
    for r in records:
        c.see(r)
    return c.count


# ---- the recorded script error -----------------------------------------------------------------

def test_the_ranks_leaving_after_the_scripts_error_are_no_faults() -> None:
    run_ = load_run(SCRIPT_ERROR)
    st = build_status(run_, now=run_.controller[-1]["t"] + 1)
    # four times the step raised, four rounds, never past it: one script error; the three
    # goodbyes after job.failed are none
    assert [(f.node, f.reason) for f in st.faults] == [("n2", "rank reported a fault")]
    assert _count(run_.controller) == len(st.faults)
    detected = [e for e in run_.controller if e["event"] == "fault.detected"]
    assert len(detected) == 7  # as recorded: the old controller wrote the goodbyes as faults
    text = format_status(st)
    assert "connection lost" not in text and "not back yet" not in text


# ---- the rule ----------------------------------------------------------------------------------

def test_one_loss_seen_twice_in_a_round_is_one_fault_and_a_later_one_is_another() -> None:
    records = [
        _ev(0.0, "controller.start", job_id=1, active=["a", "b"], spares=["c", "d"]),
        _ev(1.0, "generation.start", generation=0, members=["a", "b"], restore_step=-1),
        _ev(2.0, "fault.detected", node="b", reason="connection lost", generation=0),
        _ev(2.1, "fault.stop_sent", generation=0, survivors=1),
        _ev(2.2, "fault.detected", node="b", reason="step exited (137)", generation=0),
        _ev(2.3, "fault.second", nodes=["b", "a"], during="recovery"),  # a: never answered
        _ev(2.4, "fault.fenced", node="b", how="step cancelled", reason="connection lost"),
        _ev(3.0, "recovery.assign", generation=1, restore_step=0, taken={"b": "c", "a": "d"},
            members=["d", "c"]),
        _ev(3.0, "generation.start", generation=1, members=["d", "c"], restore_step=0),
        _ev(5.0, "fault.detected", node="c", reason="rank reported a fault", generation=1),
        _ev(5.1, "recovery.assign", generation=2, restore_step=0, taken={}, members=["d", "c"]),
        _ev(5.1, "generation.start", generation=2, members=["d", "c"], restore_step=0),
        _ev(6.0, "fault.detected", node="c", reason="rank reported a fault", generation=2),
        _ev(6.2, "job.failed", cause="script", reason="RuntimeError: boom"),
        _ev(6.3, "fault.detected", node="d", reason="connection lost", generation=2),
        _ev(6.4, "controller.exit", code=1),
    ]
    st = build_status(RunEvents("syn", records, {}), now=7.0)
    # c's second report came before its first round was done: the same fault retried
    assert [(f.node, f.reason) for f in st.faults] == [
        ("b", "connection lost"), ("a", "not ready after fault"),
        ("c", "rank reported a fault")]
    assert st.faults[0].fenced == "step cancelled"
    assert _count(records) == 3
    from hpct_slurm.fault_count import CountingLog

    log = CountingLog(stream=io.StringIO())
    for r in records:
        log.emit(r["event"], **{k: v for k, v in r.items() if k not in ("t", "event")})
    assert log.faults.count == 3 and log.faults.ended


def test_a_rank_fault_after_its_round_was_done_is_a_new_one_and_the_node_is_never_lost():
    """A step that raised, recovered (its round done: every rank completed the first step
    after it), and raised later is two faults; retried before the round was done, one.
    Either way the node restarted in place: `status` never calls it lost, and after the job
    failed no node is in two lists."""
    records = [
        _ev(0.0, "controller.start", job_id=1, active=["a", "b"], spares=["c"]),
        _ev(1.0, "generation.start", generation=0, members=["a", "b"], restore_step=-1),
        _ev(2.0, "fault.detected", node="b", reason="rank reported a fault", generation=0),
        _ev(2.1, "fault.in_process", nodes=["b"], generation=0),
        _ev(2.2, "recovery.assign", generation=1, restore_step=3, taken={}, members=["a", "b"]),
        _ev(2.2, "generation.start", generation=1, members=["a", "b"], restore_step=3),
        _ev(2.5, "recovery.done", generation=1, restore_step=3, lost=[], taken={},
            reasons={}, recovery_s=0.3, phases={}, lost_steps=0),
        _ev(4.0, "fault.detected", node="b", reason="rank reported a fault", generation=1),
        _ev(4.1, "fault.in_process", nodes=["b"], generation=1),
        _ev(4.2, "recovery.assign", generation=2, restore_step=9, taken={}, members=["a", "b"]),
        _ev(4.2, "generation.start", generation=2, members=["a", "b"], restore_step=9),
        _ev(5.0, "fault.detected", node="b", reason="rank reported a fault", generation=2),
        _ev(5.1, "fault.in_process", nodes=["b"], generation=2),
        _ev(5.2, "job.failed", cause="script", reason="2 restarts in place made no progress"),
        _ev(5.3, "fault.detected", node="a", reason="connection lost", generation=2),
        _ev(5.4, "controller.exit", code=1),
    ]
    assert _count(records) == 2
    st = build_status(RunEvents("syn", records, {}), now=6.0)
    assert [(f.node, f.reason) for f in st.faults] == [("b", "rank reported a fault")] * 2
    assert st.members == ["a", "b"] and st.spares == ["c"]


def test_a_requeued_run_counts_on_after_the_first_ended() -> None:
    records = [_ev(0.0, "controller.start", job_id=1),
               _ev(1.0, "fault.detected", node="a", reason="connection lost"),
               _ev(2.0, "escalate.requeue", reason="no spare"),
               _ev(2.1, "fault.detected", node="b", reason="connection lost"),  # Slurm's kill
               _ev(9.0, "controller.start", job_id=1),
               _ev(9.5, "fault.detected", node="b", reason="connection lost")]
    assert _count(records) == 2


# ---- what status says of a fault afterwards ----------------------------------------------------

FOLDED = [
    _ev(0.0, "controller.start", job_id=3, active=["a", "b"], spares=["c", "d"]),
    _ev(1.0, "generation.start", generation=0, members=["a", "b"], restore_step=-1),
    _ev(4.0, "fault.detected", node="b", reason="connection lost", generation=0),
    _ev(4.1, "fault.stop_sent", generation=0, survivors=1),
    _ev(4.2, "fault.fenced", node="b", how="step cancelled", reason="connection lost"),
    _ev(4.5, "recovery.assign", generation=1, restore_step=2, taken={"b": "c"},
        members=["a", "c"], sources={"0": "own", "1": "peer"}),
    _ev(4.5, "generation.start", generation=1, members=["a", "c"], restore_step=2),
    # the taker dies before the first step: its round is folded into the next
    _ev(4.8, "fault.detected", node="c", reason="connection lost", generation=1),
    _ev(4.9, "fault.stop_sent", generation=1, survivors=1),
    _ev(5.0, "fault.fenced", node="c", how="node down", reason="connection lost"),
    _ev(5.2, "recovery.assign", generation=2, restore_step=2, taken={"c": "d"},
        members=["a", "d"], sources={"0": "own", "1": "peer"}),
    _ev(5.2, "generation.start", generation=2, members=["a", "d"], restore_step=2),
    _ev(6.0, "recovery.done", generation=2, restore_step=2, lost=["b", "c"],
        taken={"b": "c", "c": "d"}, reasons={"b": "connection lost", "c": "connection lost"},
        recovery_s=2.0, phases={"detect_to_stop": 0.1}),
    # b, fenced alive, came back as a spare
    _ev(6.5, "step.launch", node="b", role="spare"),
    _ev(9.0, "job.done", generation=2, lost=["b", "c"]),
    _ev(9.5, "controller.exit", code=0),
]
FOLDED_RANKS = {
    "a-0": [_ev(1.2, "rank.adopted", rank=0, generation=0, restore_step=-1, source="creation",
                reform_s=0.1, restore_s=0.0),
            *[_ev(1.5 + s, "rank.step", rank=0, generation=0, step=s) for s in range(3)],
            _ev(5.5, "rank.adopted", rank=0, generation=2, restore_step=2, source="own",
                reform_s=0.1, restore_s=0.0),
            _ev(6.0, "rank.step", rank=0, generation=2, step=3)],
    "b-0": [_ev(1.2, "rank.adopted", rank=1, generation=0, restore_step=-1, source="creation",
                reform_s=0.1, restore_s=0.0),
            *[_ev(1.5 + s, "rank.step", rank=1, generation=0, step=s) for s in range(3)],
            _ev(4.3, "rank.exit", rank=1, reason="stopped"),
            # relaunched as a spare: its reports carry rank -1 from here on
            _ev(7.0, "rank.registered", role="spare", pid=9),
            _ev(7.1, "rank.ready", rank=-1, healthy=True)],
    "d-0": [_ev(5.5, "rank.adopted", rank=1, generation=2, restore_step=2, source="10.0.0.1:5",
                reform_s=0.1, restore_s=0.1),
            _ev(6.0, "rank.step", rank=1, generation=2, step=3)],
}


def test_a_round_folded_into_the_next_is_back_with_it_and_nothing_is_not_back_at_the_end():
    st = build_status(RunEvents("syn", FOLDED, FOLDED_RANKS), now=10.0)
    b, c = st.faults
    assert (b.node, b.replaced_by, b.recovered_in, b.recovery_s) == ("b", "c", 2, 2.0)
    assert (c.node, c.replaced_by, c.recovered_in, c.recovery_s) == ("c", "d", 2, 2.0)
    text = format_status(st)
    assert "not back yet" not in text
    assert "    b replaced by c, back in 2.000 s (generation 2)" in text


def test_a_node_fenced_alive_and_back_as_a_spare_says_the_rank_it_held():
    st = build_status(RunEvents("syn", FOLDED, FOLDED_RANKS), now=10.0)
    b = next(r for r in st.ranks if r.process == "b-0")
    assert (b.state, b.rank, b.generation, b.step, b.replaced_by) == ("spare", 1, 0, 2, "c")
    (line,) = [ln for ln in format_status(st).splitlines() if ln.lstrip().startswith("b-0")]
    assert "a spare again (replaced by c) (held rank 1, gen 0, step 2)" in line
    assert "never held a rank" not in line


def test_a_fault_whose_round_the_job_ended_before_is_never_back():
    cut = [e for e in FOLDED if e["t"] < 5.5] + [
        _ev(5.6, "recovery.failed", error="no spare"),
        _ev(5.7, "escalate.requeue", reason="no spare"),
        _ev(5.9, "controller.exit", code=75)]
    st = build_status(RunEvents("syn", cut, {}), now=10.0)
    text = format_status(st)
    assert "not back yet" not in text
    assert "never back: the job ended (requeued) first" in text
