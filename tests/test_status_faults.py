"""Issue 31.3: `hpct-slurm status` after a fault says, per fault, when, which node, what
replaced it, the recovery time, the steps recomputed and where the state came from (`--json`
the same, documented field by field); a replaced process is shown as replaced, not as a live
rank beside its replacement. The numbers are the report's (one model, two views)."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from hpct_slurm.cli import main
from hpct_slurm.report.cli import format_status, load_run
from hpct_slurm.report.model import (FaultStatus, RankStatus, RunEvents, Status, build_report,
                                     build_status, source_kind)

FIXTURE = Path(__file__).parent / "data" / "report-run"   # n3 crashed, n5 took rank 2
DOCS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
T_DONE = 1795318824.4748666


def _ev(t: float, event: str, **fields) -> dict:
    return {"t": t, "event": event, **fields}


def _steps(rank: int, gen: int, at: dict[int, float]) -> list[dict]:
    return [_ev(t, "rank.step", rank=rank, generation=gen, step=s) for s, t in at.items()]


# ---- the recorded run ------------------------------------------------------------------------

def test_status_of_the_recorded_run_says_what_the_fault_cost() -> None:
    run = load_run(FIXTURE)
    st = build_status(run, now=T_DONE + 10)
    (f,) = st.faults
    assert (f.node, f.reason, f.replaced_by, f.recovered_in, f.restore_step,
            f.recomputed_steps) == ("n3", "connection lost", "n5", 1, 21, 0)
    assert f.state_sources == {0: "own", 1: "own", 2: "peer", 3: "own"}
    # the report's own recovery, not a second computation of it
    (rec,) = build_report(run).recoveries
    assert f.recovery_s == rec.recovery_s == pytest.approx(1.8259029388427734)
    assert f.t_s == build_report(run).faults[0].t_s

    by = {r.process: r for r in st.ranks}
    assert (by["n3-0"].state, by["n3-0"].replaced_by, by["n3-0"].rank) == ("replaced", "n5", 2)
    assert (by["n5-0"].state, by["n5-0"].rank) == ("member", 2)
    assert [r.process for r in st.ranks if r.state == "member" and r.rank == 2] == ["n5-0"]


def test_status_text_shows_the_replacement_not_two_ranks_2(capsys) -> None:
    assert main(["status", str(FIXTURE)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln for ln in lines if re.search(r"rank +2 ", ln)] == \
        [ln for ln in lines if ln.lstrip().startswith("n5-0")]
    (n3,) = [ln for ln in lines if ln.lstrip().startswith("n3-0")]
    assert "replaced by n5 (held rank 2, gen 0, step 20)" in n3
    i = next(i for i, ln in enumerate(lines) if "fault at" in ln)
    assert lines[i + 1] == ("    n3 replaced by n5, back in 1.826 s (generation 1): restored "
                            "step 21, 0 step(s) recomputed; state from own (ranks 0,1,3), "
                            "peer (rank 2)")


def test_status_json_carries_the_same_per_fault_record(capsys) -> None:
    assert main(["status", str(FIXTURE), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (f,) = out["faults"]
    assert {k: f[k] for k in ("node", "replaced_by", "recovered_in", "restore_step",
                              "recomputed_steps", "state_sources")} == \
        {"node": "n3", "replaced_by": "n5", "recovered_in": 1, "restore_step": 21,
         "recomputed_steps": 0,
         "state_sources": {"0": "own", "1": "own", "2": "peer", "3": "own"}}
    assert f["recovery_s"] == pytest.approx(1.8259029388427734)
    n3 = next(r for r in out["ranks"] if r["process"] == "n3-0")
    assert (n3["state"], n3["replaced_by"]) == ("replaced", "n5")


# ---- synthetic: recomputed steps, ring and disk sources, a spare lost, mid-recovery ---------

CONTROLLER = [
    _ev(0.0, "controller.start", job_id=7, active=["a", "b"], spares=["c", "d"],
        tasks_per_node=1),
    _ev(1.0, "generation.start", generation=0, members=["a", "b"], restore_step=-1),
    # a warm spare lost while the job trains: nothing to replace
    _ev(3.0, "fault.detected", node="d", reason="step exited (1)", generation=0, role="spare"),
    _ev(3.1, "fault.fenced", node="d", how="step cancelled", reason="step exited (1)"),
    _ev(5.0, "fault.detected", node="b", reason="connection lost", generation=0, role="active"),
    _ev(5.1, "fault.stop_sent", generation=0, survivors=1),
    _ev(5.2, "fault.fenced", node="b", how="node down", reason="connection lost"),
    _ev(6.0, "recovery.assign", generation=1, restore_step=2, taken={"b": "c"},
        members=["a", "c"], sources={"0": "disk", "1": "ring"}),
    _ev(6.0, "generation.start", generation=1, members=["a", "c"], restore_step=2),
    _ev(7.5, "recovery.done", generation=1, restore_step=2, lost=["b"], taken={"b": "c"},
        reasons={"b": "connection lost"}, recovery_s=2.5,
        phases={"detect_to_stop": 0.1, "fence": 0.1, "survivors_ready": 0.8,
                "reform_restore_first_step": 1.5}),
    _ev(10.0, "job.done", generation=1, lost=["b"]),
    _ev(10.5, "controller.exit", code=0),
]
RANKS = {
    "a-0": [_ev(1.5, "rank.adopted", rank=0, generation=0, restore_step=-1,
                source="creation", reform_s=0.1, restore_s=0.0),
            *_steps(0, 0, {0: 2.0, 1: 3.0, 2: 4.0, 3: 4.5, 4: 4.9}),
            _ev(6.5, "rank.adopted", rank=0, generation=1, restore_step=2,
                source="disk:/run/persist", reform_s=0.2, restore_s=0.3),
            *_steps(0, 1, {3: 7.0, 4: 7.3, 5: 8.0})],
    "b-0": [_ev(1.4, "rank.adopted", rank=1, generation=0, restore_step=-1,
                source="creation", reform_s=0.1, restore_s=0.0),
            *_steps(1, 0, {0: 2.1, 1: 3.1, 2: 4.1, 3: 4.6})],
    "c-0": [_ev(0.5, "rank.registered", role="spare", pid=1),
            _ev(6.6, "rank.adopted", rank=1, generation=1, restore_step=2,
                source="10.0.0.1:5", reform_s=0.3, restore_s=0.25),
            *_steps(1, 1, {3: 7.1, 4: 7.4, 5: 8.1})],
    "d-0": [_ev(0.5, "rank.registered", role="spare", pid=2)],
}


def _run(cut: float = 99.0) -> RunEvents:
    return RunEvents("syn", [e for e in CONTROLLER if e["t"] < cut],
                     {k: [e for e in v if e["t"] < cut] for k, v in RANKS.items()})


def test_each_fault_has_its_replacement_cost_and_sources() -> None:
    st = build_status(_run(), now=11.0)
    d, b = st.faults
    assert (b.replaced_by, b.recovery_s, b.restore_step, b.recomputed_steps) == ("c", 2.5, 2, 2)
    assert b.state_sources == {0: "disk", 1: "ring"}
    assert (d.role, d.recovered_in, d.replaced_by, d.recovery_s) == ("spare", None, None, None)
    # the per-fault recomputed steps are the report's: steps 3 and 4 trained twice
    assert build_report(_run()).steps_recomputed == b.recomputed_steps
    assert {r.process: (r.state, r.replaced_by) for r in st.ranks} == {
        "a-0": ("member", None), "b-0": ("replaced", "c"), "c-0": ("member", None),
        "d-0": ("lost", None)}
    text = format_status(st).splitlines()
    assert "    b replaced by c, back in 2.500 s (generation 1): restored step 2, 2 step(s) " \
           "recomputed; state from disk (rank 0), ring (rank 1)" in text
    assert "    a warm spare: nothing to replace" in text


def test_during_the_recovery_the_lost_node_is_lost_and_the_fault_is_recovering() -> None:
    st = build_status(_run(cut=5.5), now=5.5)
    assert (st.state, st.spares) == ("recovering", ["c"])
    b = st.faults[1]
    assert (b.recovered_in, b.replaced_by, b.recovery_s) == (None, None, None)
    by = {r.process: r for r in st.ranks}
    assert (by["b-0"].state, by["b-0"].rank) == ("lost", 1)
    text = format_status(st).splitlines()
    assert any(ln.startswith("  b-0          lost (held rank 1, gen 0, step 3)") for ln in text)
    assert text[-1] == "    recovering"

    # assigned, the first step not done yet: the replacement is known, the time not yet
    st = build_status(_run(cut=6.7), now=6.7)
    b = st.faults[1]
    assert (b.replaced_by, b.recovery_s, b.restore_step) == ("c", None, 2)
    assert {r.process: r.state for r in st.ranks}["b-0"] == "replaced"
    assert "b replaced by c, not back yet (generation 1)" in format_status(st)


def test_a_fault_that_ended_in_a_requeue_is_not_recovered_in_place() -> None:
    controller = [
        _ev(0.0, "controller.start", job_id=9, active=["a"], spares=[]),
        _ev(1.0, "generation.start", generation=0, members=["a"], restore_step=-1),
        _ev(4.0, "fault.detected", node="a", reason="no heartbeat for 3.0 s", generation=0,
            role="active"),
        _ev(4.1, "recovery.failed", error="1 node(s) lost (a) but only 0 warm spare(s)"),
        _ev(4.2, "escalate.requeue", reason="1 node(s) lost (a) but only 0 warm spare(s)"),
        _ev(4.5, "controller.exit", code=1),
    ]
    st = build_status(RunEvents("syn", controller, {"a-0": _steps(0, 0, {0: 2.0})}), now=5.0)
    assert st.faults[0].recovered_in is None
    text = format_status(st).splitlines()
    i = next(i for i, ln in enumerate(text) if "fault at" in ln)
    assert text[i + 1] == "    not recovered in place"
    assert text[-1].startswith("requeued: infrastructure failure")


def test_source_kinds_from_the_ranks_adoptions() -> None:
    assert source_kind("own") == "own"
    assert source_kind("fresh") == source_kind("creation") == "creation"
    assert source_kind("disk:/x/persist", "disk") == "disk"
    assert source_kind("10.0.0.1:5", "peer") == source_kind("10.0.0.1:5") == "peer"
    assert source_kind("10.0.0.1:5", "ring") == "ring"
    assert source_kind("10.0.0.1:5,10.0.0.2:6", "peer") == "peer"     # a striped pull


# ---- the documentation ----------------------------------------------------------------------

def _documented(section: str) -> list[str]:
    """The field names of the table under `section` in docs/operations.md."""
    after = DOCS.read_text().split(section, 1)[1]
    table = re.search(r"^\|.*?(?=\n\n|\Z)", after, re.M | re.S).group(0)
    return [m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", table, re.M)]


@pytest.mark.parametrize("section, cls", [("### `status --json`", Status),
                                          ("`ranks[]`, one per process", RankStatus),
                                          ("`faults[]`, one per fault", FaultStatus)])
def test_every_status_json_field_is_documented(section: str, cls: type) -> None:
    assert _documented(section) == [f.name for f in dataclasses.fields(cls)]


def test_a_requeued_job_that_cannot_start_says_why():
    """Issue 30: a requeued job PENDING for nodes that are down says so in `status`, with
    Slurm's reason and the nodes that cannot take it; running again, it says nothing more."""
    from hpct_slurm.report.model import pending_note

    nodes = {"n1": "idle", "n2": "down*", "n3": "idle", "n4": "drained", "n5": "idle*",
             "n6": "allocated"}
    note = pending_note("PENDING", "ReqNodeNotAvail, UnavailableNodes:n2,n4", nodes)
    assert note is not None
    assert "reason: ReqNodeNotAvail, UnavailableNodes:n2,n4" in note
    assert "3 of the cluster's 6 nodes can take it now, not n2, n4, n5 (down or drained)" in note
    assert "State=RESUME" in note
    assert pending_note("RUNNING", None, nodes) is None
    assert "reason: none given" in pending_note("PENDING", None, {"n1": "idle"})


def test_status_asks_slurm_about_a_requeued_job_and_survives_its_silence():
    """`status` of a requeued job reads Slurm's view; a Slurm that does not answer is a
    note, not a traceback (the rest of the status comes from the run's events)."""
    from hpct_slurm.errors import HpctError
    from hpct_slurm.report.cli import _slurm_says
    from hpct_slurm.slurm.client import JobInfo

    class PendingSlurm:  # the Slurm client's two calls `status` makes, answered as Slurm does
        def show_job(self, job_id):
            return JobInfo(job_id, "train", "u", "PENDING", [], None, 1, "Resources", 0, 0,
                           None)

        def node_states(self):
            return {"n1": "idle", "n2": "down*"}

    class SilentSlurm:
        def show_job(self, job_id):
            raise HpctError("scontrol: error: Unable to contact slurm controller")

    assert "Slurm holds the requeued job PENDING (reason: Resources); 1 of the cluster's 2" \
        in _slurm_says(7, PendingSlurm())
    assert _slurm_says(7, SilentSlurm()) == (
        "Slurm: could not read job 7 now (scontrol: error: Unable to contact slurm controller)")
