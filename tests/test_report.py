"""`hpct-slurm status` / `report`: the model on a real run dir (tests/data/report-run: the
demo's hpct run, node n3 crashed at step ~21, spare n5 took rank 2) and on small synthetic logs
for the cases that run did not have (recomputed steps, a requeue, a second fault)."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from hpct_slurm.cli import main
from hpct_slurm.errors import HpctError
from hpct_slurm.report.cli import load_run, resolve_run_dir
from hpct_slurm.report.model import RunEvents, build_report, build_status
from hpct_slurm.report.records import parse_jsonl
from hpct_slurm.slurm.client import SlurmClient

FIXTURE = Path(__file__).parent / "data" / "report-run"
T_START = 1795318799.9212487       # controller.start
T_GEN0 = 1795318813.371979         # generation.start 0
T_DONE = 1795318824.4748666        # job.done


def _fixture_run(cut: float | None = None) -> RunEvents:
    """The fixture, optionally as it stood at unix time `cut` (a running job)."""
    run = load_run(FIXTURE)
    if cut is None:
        return run
    return RunEvents(run.run_dir, [e for e in run.controller if e["t"] < cut],
                     {k: [e for e in v if e["t"] < cut] for k, v in run.ranks.items()})


# ---- the real run ------------------------------------------------------------------------

def test_report_of_the_demo_run_matches_hand_computed_numbers() -> None:
    rep = build_report(_fixture_run())
    assert rep.job_id == 2 and rep.outcome == "done" and rep.attempts == 1
    assert rep.start_unix == T_START
    assert rep.startup_s == pytest.approx(T_GEN0 - T_START)
    assert rep.wall_s == pytest.approx(T_DONE - T_GEN0)            # 11.103 s
    # gen 0: from the last rank.adopted (n3, .391399) to the last rank logging step 21
    # (n2? .2369688); gen 1: from the last rank.adopted (n2, 817.937954) to step 59 (n4)
    productive = (816.2369688 - 813.391399) + (822.7231333 - 817.937954)
    assert rep.productive_s == pytest.approx(productive, abs=1e-6)  # 7.631 s
    assert rep.goodput == pytest.approx(productive / (T_DONE - T_GEN0), abs=1e-6)
    assert (rep.steps_completed, rep.step_runs, rep.steps_recomputed) == (60, 60, 0)

    g0, g1 = rep.generations
    assert (g0.generation, g0.members, g0.restore_step) == (0, ["n1", "n2", "n3", "n4"], -1)
    assert (g0.first_step, g0.last_step, g0.steps) == (0, 21, 22)
    assert (g1.generation, g1.members, g1.restore_step) == (1, ["n1", "n2", "n5", "n4"], 21)
    assert (g1.first_step, g1.last_step, g1.steps) == (22, 59, 38)
    assert g0.end_s == pytest.approx(g1.start_s)
    assert g1.end_s == pytest.approx(T_DONE - T_START)

    (fault,) = rep.faults
    assert (fault.node, fault.reason, fault.generation, fault.role, fault.fenced) == \
        ("n3", "connection lost", 0, "active", "node down")
    assert fault.t_s == pytest.approx(1795318816.262941 - T_START)
    assert not fault.during_recovery

    (rec,) = rep.recoveries
    assert (rec.generation, rec.restore_step, rec.lost, rec.taken) == \
        (1, 21, ["n3"], {"n3": "n5"})
    assert rec.recovery_s == pytest.approx(1.8259029388427734)
    assert rec.detect_s == pytest.approx(1795318818.0890467 - 1.8259029388427734 - T_START)
    assert rec.phases["survivors_ready"] == pytest.approx(1.6306078433990479)
    assert sum(rec.phases.values()) == pytest.approx(rec.recovery_s, abs=1e-3)
    assert rec.max_teardown_s == pytest.approx(1.3934502601623535)   # n2's rank.ready
    assert rec.max_reform_s == pytest.approx(0.013401985168457031)   # n2's rank.adopted
    assert rec.max_restore_s == pytest.approx(0.006620168685913086)  # n5 pulled from n1
    assert rec.restore_sources == {0: "own", 1: "own", 2: "10.77.0.11:36427", 3: "own"}


def test_status_of_the_demo_run_while_it_ran() -> None:
    # generation 0 training: every member logged steps; n5 waits as a warm spare
    st = build_status(_fixture_run(cut=1795318815.0), now=1795318815.0)
    assert (st.state, st.generation, st.spares) == ("running", 0, ["n5"])
    assert st.members == ["n1", "n2", "n3", "n4"]
    by = {r.process: r for r in st.ranks}
    assert by["n5-0"].rank is None and by["n5-0"].step is None
    assert by["n3-0"].rank == 2 and by["n3-0"].generation == 0
    assert st.step == min(r.step for r in st.ranks if r.step is not None)
    assert all(r.last_seen_s >= 0 for r in st.ranks)
    assert st.faults == []

    # n3 crashed, survivors are tearing down: recovering, n5 still spare
    st = build_status(_fixture_run(cut=1795318817.0), now=1795318817.0)
    assert (st.state, st.generation, st.spares) == ("recovering", 0, ["n5"])
    assert [f.node for f in st.faults] == ["n3"]

    # n5 took n3's place: generation 1, no spare left, first step not yet done
    st = build_status(_fixture_run(cut=1795318818.0), now=1795318818.0)
    assert (st.state, st.generation, st.spares) == ("recovering", 1, [])
    assert st.members == ["n1", "n2", "n5", "n4"]

    st = build_status(_fixture_run(), now=T_DONE + 10)
    assert (st.state, st.generation, st.step, st.recoveries_done) == ("done", 1, 59, 1)


def test_status_rank_is_each_processs_own_not_the_rank_its_last_event_names(tmp_path) -> None:
    """n4 (rank 3) holds n5's rank-2 replica: its last events name rank 2."""
    run = tmp_path / "hpct-2"
    shutil.copytree(FIXTURE, run)
    with open(run / "events" / "n4-0.jsonl", "a") as f:
        f.write(json.dumps(_ev(T_DONE + 1, "replica.stored", source="n4/0", server_rank=3,
                               rank=2, step=59, nbytes=120)) + "\n")
        f.write(json.dumps(_ev(T_DONE + 2, "transfer.served", source="n4/0", server_rank=3,
                               rank=2, step=59)) + "\n")
    st = build_status(load_run(run), now=T_DONE + 10)
    assert {r.process: r.rank for r in st.ranks} == {"n1-0": 0, "n2-0": 1, "n3-0": 2, "n4-0": 3,
                                                     "n5-0": 2}
    assert {r.process: r.last_event for r in st.ranks}["n4-0"] == "transfer.served"


def test_status_says_when_a_fault_was_and_since_what(capsys) -> None:
    assert main(["status", str(FIXTURE)]) == 0
    fault = [ln for ln in capsys.readouterr().out.splitlines() if "fault" in ln]
    t_fault = 1795318816.262941
    clock = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t_fault))
    assert fault == [f"  fault at {clock} ({t_fault - T_START:.2f} s after the job started)  "
                     f"n3: connection lost"]
    assert main(["report", str(FIXTURE)]) == 0
    start = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(T_START))
    assert f"started {start}: times below are seconds since then" in capsys.readouterr().out
    assert main(["status", str(FIXTURE), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["start_unix"] == T_START


# ---- synthetic logs for what the demo run lacks --------------------------------------------

def _ev(t: float, event: str, **fields) -> dict:
    return {"t": t, "event": event, **fields}


def _steps(rank: int, gen: int, at: dict[int, float]) -> list[dict]:
    return [_ev(t, "rank.step", rank=rank, generation=gen, step=s) for s, t in at.items()]


def test_recomputed_steps_and_a_second_fault() -> None:
    phases = {"detect_to_stop": 0.1, "fence": 0.1, "survivors_ready": 0.8,
              "reform_restore_first_step": 1.5}
    controller = [
        _ev(0.0, "controller.start", job_id=7, active=["a", "b"], spares=["c", "d"]),
        _ev(1.0, "generation.start", generation=0, members=["a", "b"], restore_step=-1),
        _ev(5.0, "fault.detected", node="b", reason="connection lost", generation=0,
            role="active"),
        _ev(5.1, "fault.stop_sent", generation=0, survivors=1),
        _ev(5.2, "fault.fenced", node="b", how="node down", reason="connection lost"),
        _ev(5.3, "fault.detected", node="d", reason="step exited (1)", generation=0,
            role="spare"),
        _ev(5.4, "fault.fenced", node="d", how="step cancelled", reason="step exited (1)"),
        _ev(6.0, "recovery.assign", generation=1, restore_step=1, taken={"b": "c"},
            members=["a", "c"]),
        _ev(6.0, "generation.start", generation=1, members=["a", "c"], restore_step=1),
        _ev(7.5, "recovery.done", generation=1, restore_step=1, lost=["b"],
            taken={"b": "c"}, reasons={"b": "connection lost"}, recovery_s=2.5,
            phases=phases),
        _ev(10.0, "job.done", generation=1, lost=["b"]),
        _ev(10.5, "controller.exit", code=0),
    ]
    ranks = {
        "a-0": [_ev(1.5, "rank.adopted", rank=0, generation=0, restore_step=-1,
                    source="fresh", reform_s=0.1, restore_s=0.0),
                *_steps(0, 0, {0: 2.0, 1: 3.0, 2: 4.0}),
                _ev(5.05, "rank.fault", rank=0, generation=0, error="RuntimeError: x"),
                _ev(5.5, "rank.ready", rank=0, latest_step=2, teardown_s=0.4),
                _ev(6.5, "rank.adopted", rank=0, generation=1, restore_step=1,
                    source="own", reform_s=0.2, restore_s=0.1),
                *_steps(0, 1, {2: 7.0, 3: 8.0})],
        "b-0": [_ev(1.4, "rank.adopted", rank=1, generation=0, restore_step=-1,
                    source="fresh", reform_s=0.1, restore_s=0.0),
                *_steps(1, 0, {0: 2.1, 1: 3.1})],
        "c-0": [_ev(6.6, "rank.adopted", rank=1, generation=1, restore_step=1,
                    source="10.0.0.1:5", reform_s=0.3, restore_s=0.25),
                *_steps(1, 1, {2: 7.2, 3: 8.1})],
    }
    rep = build_report(RunEvents("syn", controller, ranks))
    # step 2 was completed by gen 0 (rank 0 only) and again by gen 1: one recomputation
    assert (rep.steps_completed, rep.step_runs, rep.steps_recomputed) == (4, 5, 1)
    assert [(s.generation, s.step, s.recomputed) for s in rep.steps] == \
        [(0, 0, False), (0, 1, False), (0, 2, True), (1, 2, False), (1, 3, False)]
    # kept: step 0 (2.1 - 1.5), step 1 (3.1 - 2.1), step 2 again (7.2 - 6.6), step 3 (8.1 - 7.2)
    assert rep.productive_s == pytest.approx(0.6 + 1.0 + 0.6 + 0.9)
    assert rep.wall_s == pytest.approx(9.0)
    assert rep.goodput == pytest.approx(3.1 / 9.0)
    (rec,) = rep.recoveries
    assert rec.detect_s == pytest.approx(5.0) and rec.done_s == pytest.approx(7.5)
    assert (rec.max_teardown_s, rec.max_reform_s, rec.max_restore_s) == (0.4, 0.3, 0.25)
    assert rec.restore_sources == {0: "own", 1: "10.0.0.1:5"}
    assert [(f.node, f.role, f.fenced, f.during_recovery) for f in rep.faults] == \
        [("b", "active", "node down", False), ("d", "spare", "step cancelled", True)]
    st = build_status(RunEvents("syn", controller, ranks), now=11.0)
    assert st.spares == [] and st.members == ["a", "c"] and st.state == "done"


def test_requeued_job_counts_attempts_and_redone_steps() -> None:
    controller = [
        _ev(0.0, "controller.start", job_id=9, active=["a"], spares=[]),
        _ev(1.0, "generation.start", generation=0, members=["a"], restore_step=-1),
        _ev(4.0, "fault.detected", node="a", reason="no heartbeat for 3.0 s",
            generation=0, role="active"),
        _ev(4.1, "recovery.failed", error="1 node(s) lost (a) but only 0 warm spare(s)"),
        _ev(4.2, "escalate.requeue", reason="1 node(s) lost (a) but only 0 warm spare(s)"),
        _ev(4.5, "controller.exit", code=1),
        _ev(10.0, "controller.start", job_id=9, active=["a"], spares=[]),
        _ev(10.5, "controller.resume_from_disk", step=0),
        _ev(11.0, "generation.start", generation=0, members=["a"], restore_step=0),
        _ev(14.0, "job.done", generation=0, lost=[]),
    ]
    ranks = {"a-0": [
        _ev(1.5, "rank.adopted", rank=0, generation=0, restore_step=-1, source="fresh",
            reform_s=0.0, restore_s=0.0),
        *_steps(0, 0, {0: 2.0, 1: 3.0}),
        _ev(11.5, "rank.adopted", rank=0, generation=0, restore_step=0, source="disk:x",
            reform_s=0.0, restore_s=0.1),
        *_steps(0, 0, {1: 12.0, 2: 13.0})]}
    rep = build_report(RunEvents("syn", controller, ranks))
    assert (rep.attempts, rep.outcome) == (2, "done")
    assert [(g.attempt, g.generation, g.steps) for g in rep.generations] == [(0, 0, 2),
                                                                              (1, 0, 2)]
    assert (rep.steps_completed, rep.step_runs, rep.steps_recomputed) == (3, 4, 1)
    assert rep.productive_s == pytest.approx(0.5 + 0.5 + 1.0)
    assert rep.wall_s == pytest.approx(13.0)
    assert [e.event for e in rep.escalations] == ["recovery.failed", "escalate.requeue"]
    assert rep.recoveries == []
    # the first attempt alone: requeued
    first = RunEvents("syn", controller[:6], {"a-0": ranks["a-0"][:3]})
    assert build_report(first).outcome == "requeued"
    assert build_status(first, now=5.0).state == "requeued"
    assert build_status(first, now=5.0).notes == [
        "requeued: infrastructure failure: 1 node(s) lost (a) but only 0 warm spare(s)"]


def test_status_says_whose_failure_ended_the_job_and_what_was_not_exact() -> None:
    """Issues 18 and 19: a script error (not requeued), too few spares, and a restore that
    had to come from disk are each one line of `status`, never silent."""
    controller = [
        _ev(0.0, "controller.start", job_id=9, active=["a", "b"], spares=[]),
        _ev(0.0, "controller.spares_short", wanted=1, got=0, action="warn", nodes=2,
            restart_count=0),
        _ev(1.0, "generation.start", generation=0, members=["a", "b"], restore_step=-1),
        _ev(2.0, "recovery.assign", generation=1, restore_step=10, taken={}, members=["a", "b"],
            newest_held=14, sources={"0": "disk", "1": "disk"}),
        _ev(2.0, "recovery.disk_fallback", generation=1, restore_step=10, ranks=[0, 1],
            newest_held=14),
        _ev(3.0, "job.failed", cause="script",
            reason="the training command failed before its first step on a, b: "
                   "FileNotFoundError: x"),
        _ev(3.5, "controller.exit", code=1),
    ]
    st = build_status(RunEvents("syn", controller, {}), now=4.0)
    assert st.state == "failed"
    assert st.notes[0] == "warning: asked for 1 warm spare(s), the allocation gave 0"
    assert "restored step 10 from disk" in st.notes[1] and "recomputed" in st.notes[1]
    assert st.notes[2].startswith("ended: the training script's own error, not requeued:")
    assert "FileNotFoundError: x" in st.notes[2]


# ---- parsing and bad input ---------------------------------------------------------------

def test_logs_of_something_else_are_clear_errors() -> None:
    start = _ev(0.0, "controller.start", job_id=1, active=["a"], spares=[])
    with pytest.raises(HpctError, match="has no controller.start: not a run of"):
        build_report(RunEvents("x", [_ev(0.0, "baseline.launch", nodes=["a"])], {}))
    # a record without a field the report reads is left out, said in one warning line
    rep = build_report(RunEvents("x", [start], {"a-0": [_ev(1.0, "rank.step", rank=0, step=3)]}))
    assert rep.step_runs == 0 and rep.warnings[0] == (
        "events/a-0.jsonl t=1.0: a rank.step without generation (written by another version "
        "of hpct-slurm?): left out")
    rep = build_report(RunEvents("x", [start, _ev(1.0, "generation.start", generation=0,
                                                   members=["a"], restore_step=-1)], {}))
    assert rep.goodput is None and "no rank events" in rep.warnings[0]


def test_torn_last_line_is_dropped_with_a_warning_and_a_bad_middle_line_left_out() -> None:
    good = json.dumps(_ev(1.0, "rank.step", rank=0, generation=0, step=0))
    records, warnings = parse_jsonl(good + "\n" + '{"t": 2.0, "event": "rank.st', "f.jsonl")
    assert len(records) == 1 and "f.jsonl: last line 2 is torn" in warnings[0]
    assert parse_jsonl(good + "\n\n", "f.jsonl") == ([json.loads(good)], [])
    assert parse_jsonl("garbage\n" + good + "\n", "f.jsonl") == (
        [json.loads(good)], ["f.jsonl line 1 ('garbage'): not JSON: left out"])
    records, warnings = parse_jsonl(good + '\n{"event": "x"}\n' + good, "f.jsonl")
    assert len(records) == 2 and warnings == [
        "f.jsonl line 2 ('{\"event\": \"x\"}'): a x without a time 't': left out"]


def test_cli_report_and_status_print_one_json_object(capsys) -> None:
    assert main(["report", str(FIXTURE), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps_completed"] == 60 and out["recoveries"][0]["taken"] == {"n3": "n5"}
    assert "steps" not in out
    assert main(["report", str(FIXTURE), "--json", "--steps"]) == 0
    assert len(json.loads(capsys.readouterr().out)["steps"]) == 60
    assert main(["status", str(FIXTURE), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "done" and out["members"] == ["n1", "n2", "n5", "n4"]
    assert main(["report", str(FIXTURE)]) == 0
    text = capsys.readouterr().out
    assert "goodput 68.7%" in text and "n3->n5" in text


def test_cli_writes_a_png_timeline(tmp_path: Path, capsys) -> None:
    png = tmp_path / "timeline.png"
    assert main(["report", str(FIXTURE), "--json", "--png", str(png)]) == 0
    assert json.loads(capsys.readouterr().out)["png"] == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert main(["report", str(FIXTURE), "--png", str(tmp_path / "no" / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_bad_run_dirs_are_clear_errors(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("HPCT: ") and "is neither an existing run dir" in err
    assert main(["status", str(tmp_path)]) == 2
    assert "has no controller.jsonl" in capsys.readouterr().err

    run = tmp_path / "hpct-2"
    shutil.copytree(FIXTURE, run)
    with open(run / "events" / "n3-0.jsonl", "a") as f:
        f.write('{"t": 1795318816.2, "event": "rank.st')      # the crash cut this write
    assert main(["report", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["warnings"] == [
        f"{run / 'events' / 'n3-0.jsonl'}: last line 25 is torn, ignored: "
        f"'{{\"t\": 1795318816.2, \"event\": \"rank.st'"]
    assert "HPCT warning:" in captured.err and "n3-0.jsonl" in captured.err
    with open(run / "controller.jsonl", "a") as f:
        f.write("\n".join(["not json", '{"t": 1.0, "event": "x"}']) + "\n")
    assert main(["report", str(run)]) == 0  # the rest of the run is still shown
    err = capsys.readouterr().err
    assert "controller.jsonl line 26 ('not json'): not JSON: left out" in err


def test_job_id_resolution(tmp_path: Path, monkeypatch) -> None:
    run = tmp_path / "hpct-2"
    shutil.copytree(FIXTURE, run)
    assert resolve_run_dir("2", cwd=tmp_path) == run
    assert resolve_run_dir(None, cwd=tmp_path, environ={}) == run
    assert resolve_run_dir(None, cwd=Path("/"), environ={"HPCT_RUN_DIR": str(run)}) == run
    with pytest.raises(HpctError, match="no RUN_DIR or JOBID given"):
        resolve_run_dir(None, cwd=tmp_path / "hpct-2" / "events", environ={})
    # a job this directory does not hold goes to Slurm; Slurm's own failure is named (an
    # empty slurm.conf makes the real scontrol fail at once; a missing one retries for 60 s)
    (tmp_path / "slurm.conf").write_text("")
    no_slurm = SlurmClient(env={"SLURM_CONF": str(tmp_path / "slurm.conf")})
    with pytest.raises(HpctError, match=r"job 31337: no run dir at '.*hpct-31337' and Slurm "
                                        r"does not know the job \(scontrol show job.*"
                                        r"configuration file"):
        resolve_run_dir("31337", client=no_slurm, cwd=tmp_path)


@pytest.mark.cluster
def test_job_id_resolves_through_slurm_workdir(cluster, tmp_path: Path) -> None:
    client = cluster.client()
    for workdir, run in ((tmp_path / "a", tmp_path / "a" / "hpct-{}"), (tmp_path / "b", None)):
        workdir.mkdir()
        job = client.sbatch(options=["--hold", f"--chdir={workdir}", "-o", "/dev/null"],
                            wrap="true")
        target = Path(str(run).format(job)) if run else workdir
        target.mkdir(exist_ok=True)
        (target / "controller.jsonl").write_text(json.dumps(
            _ev(1.0, "controller.start", job_id=job, active=["n1"], spares=[])) + "\n")
        # not in the current directory: found through scontrol's WorkDir
        assert resolve_run_dir(str(job), client=client, cwd=tmp_path) == target
        client.cancel(job)
    with pytest.raises(HpctError, match="Invalid job id specified"):
        resolve_run_dir("999999", client=client, cwd=tmp_path)
