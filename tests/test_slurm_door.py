"""One door to Slurm (issue 14): no module outside hpct_slurm/slurm/ builds a Slurm command line,
and the client methods the call sites use build the right argv and parse what Slurm prints.
All offline: the client's injectable `runner` stands in for the commands."""
from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path
from typing import Callable

import pytest

import hpct_slurm
from hpct_slurm.errors import HpctError
from hpct_slurm.slurm.client import (FINISHED_JOB_STATES, REQUEUE_BEGIN_S, SlurmClient,
                                     SlurmCommandError, StepInfo, parse_job_record,
                                     parse_job_state, parse_node_record, parse_node_states,
                                     parse_sinfo_json, parse_squeue_json, parse_steps,
                                     srun_nodes_argv)

PACKAGE = Path(hpct_slurm.__file__).parent
DOOR = PACKAGE / "slurm"
# Slurm's client commands; the daemons (slurmctld, slurmd, munged) are localcluster's to start.
SLURM_COMMANDS = frozenset({
    "sbatch", "squeue", "sinfo", "scontrol", "srun", "scancel", "sacct", "salloc", "sattach",
    "sbcast", "sstat", "sacctmgr", "sreport", "sprio", "sshare", "sdiag", "strigger"})


# ---- (a) the door ------------------------------------------------------------------------

def slurm_argv_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal that is a Slurm command name: an argv's first
    word (`["squeue", ...]`, `cmd = "srun"`)."""
    return sorted((n.lineno, n.value) for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and n.value.strip() in SLURM_COMMANDS)


def test_the_scanner_sees_argv_strings() -> None:
    assert slurm_argv_strings('x = subprocess.run(["squeue", "-h"])\ny = "srun"\n') == [
        (1, "squeue"), (2, "srun")]
    assert slurm_argv_strings('"""scontrol show job: a docstring"""\nraise E("srun failed")\n'
                              ) == []
    # and the client itself is found, so the check below is not vacuous
    assert {text for _, text in slurm_argv_strings((DOOR / "client.py").read_text())} >= {
        "sbatch", "squeue", "sinfo", "scontrol", "srun", "scancel"}


def test_only_the_slurm_package_builds_slurm_commands() -> None:
    outside = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text!r}"
               for path in sorted(PACKAGE.rglob("*.py")) if DOOR not in path.parents
               for line, text in slurm_argv_strings(path.read_text(encoding="utf-8"))]
    assert outside == [], ("Slurm commands built outside hpct_slurm/slurm/ (add a SlurmClient "
                           "method instead):\n" + "\n".join(outside))


# ---- a stand-in for the commands -----------------------------------------------------------

class FakeRunner:
    """Records every command; answers each with `answer(argv)`: stdout text, a
    CompletedProcess, or an exception to raise."""

    def __init__(self, answer: Callable[[list[str]], object] = lambda argv: ""):
        self.answer = answer
        self.calls: list[tuple[list[str], dict]] = []

    def __call__(self, argv, **kwargs) -> subprocess.CompletedProcess:
        self.calls.append((list(argv), kwargs))
        out = self.answer(list(argv))
        if isinstance(out, BaseException):
            raise out
        if isinstance(out, subprocess.CompletedProcess):
            return out
        return subprocess.CompletedProcess(argv, 0, stdout=out, stderr="")

    @property
    def argvs(self) -> list[list[str]]:
        return [argv for argv, _ in self.calls]


def failed(stderr: str, rc: int = 1) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], rc, stdout="", stderr=stderr)


def client_answering(answer: Callable[[list[str]], object] = lambda argv: "",
                     **kwargs) -> tuple[SlurmClient, FakeRunner]:
    runner = FakeRunner(answer)
    return SlurmClient(runner=runner, **kwargs), runner


# ---- the runner, env and errors --------------------------------------------------------------

def test_run_goes_through_the_runner_with_wrap_env_and_timeout(monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.setenv("KEEP", "1")
    client, runner = client_answering(wrap=["nsenter", "--net=/run/netns/x", "--"],
                                      env={"SLURM_CONF": "/c", "SLURM_JOB_ID": None},
                                      timeout=7)
    client.run(["scontrol", "ping"], env={"EXTRA": "e"})
    [(argv, kw)] = runner.calls
    assert argv == ["nsenter", "--net=/run/netns/x", "--", "scontrol", "ping"]
    assert kw["timeout"] == 7 and kw["capture_output"] and kw["text"]
    env = kw["env"]
    assert env["SLURM_CONF"] == "/c" and env["EXTRA"] == "e" and env["KEEP"] == "1"
    assert "SLURM_JOB_ID" not in env  # None removes an inherited variable


def test_run_errors_name_the_command_and_what_went_wrong() -> None:
    client, _ = client_answering(lambda argv: failed("squeue: error: Unable to contact slurm "
                                                     "controller (connect failure)"))
    with pytest.raises(SlurmCommandError, match=r"squeue -h -j 5 -o %T failed \(exit 1\): "
                                                r"squeue: error: Unable to contact"):
        client.job_finished(5)
    slow, _ = client_answering(lambda argv: subprocess.TimeoutExpired(argv, 3))
    with pytest.raises(SlurmCommandError, match=r"scontrol reconfigure failed \(timed out\): "
                                                r"no answer within 30 s"):
        slow.reconfigure()
    missing, _ = client_answering(lambda argv: FileNotFoundError(argv[0]))
    with pytest.raises(SlurmCommandError, match="srun is not installed or not on PATH"):
        missing.run_step(["n1"], ["true"])


def test_status_text_reports_a_failing_command_in_the_text_instead_of_raising() -> None:
    """It is printed beside a test's own failure: Slurm being down must show, not replace it."""
    client, runner = client_answering(
        lambda argv: failed("squeue: error: Unable to contact") if argv[0] == "squeue"
        else "NODELIST STATE REASON\nn1 idle none\n")
    text = client.status_text()
    assert ("$ squeue -a -o %i %T %r %S %N: HPCT: squeue -a -o %i %T %r %S %N failed (exit 1): "
            "squeue: error: Unable to contact\n") in text
    assert "$ sinfo -N -o %N %T %E\nNODELIST STATE REASON\nn1 idle none" in text
    assert [argv[0] for argv in runner.argvs] == ["squeue", "sinfo"]


# ---- is the job finished: one set of end states --------------------------------------------

@pytest.mark.parametrize("printed, finished", [
    ("RUNNING\n", False), ("PENDING\n", False), ("COMPLETING\n", False),
    ("REQUEUED\n", False), ("", True),
    *[(f"{state}\n", True) for state in sorted(FINISHED_JOB_STATES)],
])
def test_job_finished(printed: str, finished: bool) -> None:
    client, runner = client_answering(lambda argv: printed)
    assert client.job_finished(42) is finished
    assert runner.argvs == [["squeue", "-h", "-j", "42", "-o", "%T"]]


def test_a_job_slurmctld_forgot_is_finished() -> None:
    client, _ = client_answering(
        lambda argv: failed("slurm_load_jobs error: Invalid job id specified"))
    assert client.job_finished(42) is True


def test_parse_job_state_rejects_what_is_not_one_state() -> None:
    assert parse_job_state(" RUNNING \n") == "RUNNING" and parse_job_state("\n") is None
    with pytest.raises(HpctError, match="not one job state"):
        parse_job_state("RUNNING\nRUNNING\n")
    with pytest.raises(HpctError, match="not a job state"):
        parse_job_state("squeue:")


# ---- steps ----------------------------------------------------------------------------------

def test_job_steps() -> None:
    client, runner = client_answering(
        lambda argv: "42.0 n1\n42.1 n[2-3]\n42.batch n1\n42.extern n[1-3]\n\n")
    steps = client.job_steps(42)
    assert runner.argvs == [["squeue", "-h", "-s", "-j", "42", "-o", "%i %N"]]
    assert steps[:2] == [StepInfo(42, "0", ["n1"]), StepInfo(42, "1", ["n2", "n3"])]
    assert [s.numbered for s in steps] == [True, True, False, False]
    with pytest.raises(HpctError, match="has no JOB.STEP id"):
        parse_steps("42 n1\n")
    with pytest.raises(HpctError, match="step's job id 'x' is not a Slurm job id"):
        parse_steps("x.0 n1\n")


def test_the_controller_cancels_only_the_lost_nodes_own_steps(tmp_path: Path) -> None:
    from hpct_slurm.controller import controller as ctl

    client, runner = client_answering(
        lambda argv: "7.0 n1\n7.1 n2\n7.batch n1\n7.2 n[1-2]\n" if argv[0] == "squeue" else "")
    c = ctl.Controller(ctl.Options(command=["true"], run_dir=tmp_path / "hpct-7", job_id=7,
                                   nodes=["n1", "n2"], batch_host="n1", spares=0),
                       client=client)
    c._cancel_steps_on("n1")
    assert runner.argvs[1:] == [["scancel", "--signal=KILL", "7.0"]]


# ---- sbatch with an env and script arguments -------------------------------------------------

def test_sbatch_with_env_and_script_args(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("HPCT_ROLE", raising=False)
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n")
    client, runner = client_answering(lambda argv: "123;cluster\n", env={"SLURM_CONF": "/c"})
    job = client.sbatch(script, options=["-N1", "--job-name=x"], script_args=["a", "-b"],
                        env={"HPCT_ROLE": "spare"})
    assert job == 123
    [(argv, kw)] = runner.calls
    assert argv == ["sbatch", "--parsable", "-N1", "--job-name=x", str(script), "a", "-b"]
    assert kw["env"]["HPCT_ROLE"] == "spare" and kw["env"]["SLURM_CONF"] == "/c"
    # the env is for this submission only
    client.sbatch(wrap="true")
    assert "HPCT_ROLE" not in runner.calls[1][1]["env"]
    assert runner.argvs[1] == ["sbatch", "--parsable", "--wrap=true"]


def test_sbatch_refuses_what_is_not_a_job_id(tmp_path: Path) -> None:
    client, _ = client_answering(lambda argv: "Submitted batch job 5\n")
    with pytest.raises(HpctError, match="sbatch --parsable printed 'Submitted batch job 5', "
                                        "not a job id"):
        client.sbatch(wrap="true")
    with pytest.raises(HpctError, match="does not exist"):
        client.sbatch(tmp_path / "nope.sbatch")


def test_the_companion_spare_job_goes_through_the_injected_client(tmp_path: Path) -> None:
    from hpct_slurm.controller import controller as ctl

    client, runner = client_answering(lambda argv: "55\n")
    c = ctl.Controller(ctl.Options(command=["python", "train.py"], run_dir=tmp_path / "hpct-7",
                                   job_id=7, nodes=["n1"], batch_host="n1", spares=0,
                                   pool_spares=1, tasks_per_node=2), client=client)
    c._maybe_borrow()
    assert c.borrowed == [55]
    [(argv, kw)] = runner.calls
    assert argv[:2] == ["sbatch", "--parsable"] and argv[-2:] == ["python", "train.py"]
    assert "--ntasks-per-node=2" in argv and argv[-3].endswith("companion.sbatch")
    assert kw["env"]["HPCT_ROLE"] == "spare" and kw["env"]["HPCT_TASKS_PER_NODE"] == "2"


# ---- a job's work dir -------------------------------------------------------------------------

JOB_LINE = ("JobId=7 JobName=train UserId=root(0) JobState=RUNNING Reason=None Restarts=0 "
            "ExitCode=0:0 NodeList=n[1-2] BatchHost=n1 Command=/x/job.sh "
            "WorkDir=/data/my runs StdErr=/x/out StdIn=/dev/null StdOut=/x/out Power= ")


def test_work_dir_from_scontrol_and_squeue() -> None:
    assert parse_job_record(JOB_LINE).work_dir == "/data/my runs"
    assert parse_job_record(JOB_LINE.replace("WorkDir=/data/my runs ", "")).work_dir is None
    [job] = parse_squeue_json(json.dumps({"jobs": [
        {"job_id": 7, "job_state": "RUNNING", "current_working_directory": "/w"}]}))
    assert job.work_dir == "/w"


def test_report_resolves_a_job_id_through_the_work_dir(tmp_path: Path) -> None:
    from hpct_slurm.report.cli import resolve_run_dir

    run = tmp_path / "data" / "hpct-7"
    run.mkdir(parents=True)
    (run / "controller.jsonl").write_text(json.dumps({"event": "controller.start",
                                                      "job_id": 7}) + "\n")
    client, runner = client_answering(
        lambda argv: JOB_LINE.replace("/data/my runs", str(tmp_path / "data")))
    assert resolve_run_dir("7", client=client, cwd=tmp_path / "elsewhere") == run
    assert runner.argvs == [["scontrol", "show", "job", "-o", "7"]]


# ---- node comments and features ------------------------------------------------------------------

NODE_HEAD = "NodeName=n2 Arch=x86_64 AvailableFeatures=a,b ActiveFeatures=a State=IDLE+DRAIN"


@pytest.mark.parametrize("tail, reason, comment", [
    (" Reason=hpct: x=1 [root@2026-11-22T03:18:09] Comment=hpct: spare pool add by root at "
     "2026-01-01T00:00:00Z Extra=foo", "hpct: x=1", "hpct: spare pool add by root at "
                                                   "2026-01-01T00:00:00Z"),
    (" Comment=hello world", None, "hello world"),
    (" Reason=down [root@2026-11-22T03:18:09]", "down", None),
    ("", None, None),
])
def test_node_comment_from_scontrol(tail: str, reason: str | None, comment: str | None) -> None:
    node = parse_node_record(NODE_HEAD + tail)
    assert (node.reason, node.comment) == (reason, comment)
    assert node.features == ("a", "b") and node.flags == {"DRAIN"}


def test_node_comment_from_sinfo_json() -> None:
    nodes = parse_sinfo_json(json.dumps({"nodes": [
        {"name": "n1", "state": "idle", "comment": "hpct: spare pool add"},
        {"name": "n2", "state": "idle", "comment": ""}]}))
    assert [n.comment for n in nodes] == ["hpct: spare pool add", None]


def test_set_node_features() -> None:
    client, runner = client_answering()
    client.set_node_features("n1", ("a", "hpct_spare"), comment="hpct: spare pool add")
    client.set_node_features("n2", ())
    assert runner.argvs == [
        ["scontrol", "update", "NodeName=n1", "AvailableFeatures=a,hpct_spare",
         "ActiveFeatures=a,hpct_spare", "Comment=hpct: spare pool add"],
        ["scontrol", "update", "NodeName=n2", "AvailableFeatures=", "ActiveFeatures="]]
    for bad, match in ((dict(name="n[1-2]", features=()), "not a single node name"),
                       (dict(name="n1", features=("a,b",)), "hold ','"),
                       (dict(name="n1", features=(), comment="two\nlines"),
                        "is not one printable line")):
        with pytest.raises(HpctError, match=match):
            client.set_node_features(**bad)
    assert len(runner.calls) == 2  # refused before running anything


# ---- a requeue --------------------------------------------------------------------------------

DB_INDEX = ("Job update not available right now, the DB index is being set, try again in a "
            "bit for job 7\n")


def test_requeue_sets_the_jobs_start_time_ahead_and_retries_a_refusal_for_now() -> None:
    """Slurm 22.05 holds a requeued job for the credential lifetime (120 s) after its old run
    completed, unless its BeginTime is still ahead then: the requeue sets it REQUEUE_BEGIN_S
    ahead, the same moment on a second try."""
    answers = iter(["", failed(DB_INDEX), ""])
    client, runner = client_answering(lambda argv: next(answers))
    said: list[SlurmCommandError] = []
    assert client.requeue(7, on_refused=said.append) is None
    assert runner.argvs == [
        ["scontrol", "requeue", "7"],
        ["scontrol", "update", "JobId=7", f"StartTime=now+{REQUEUE_BEGIN_S}"],
        ["scontrol", "update", "JobId=7", f"StartTime=now+{REQUEUE_BEGIN_S - 1}"]]
    assert len(said) == 1 and "DB index is being set" in said[0].stderr


def test_a_start_time_slurm_will_not_take_is_said_and_the_requeue_stands() -> None:
    client, runner = client_answering(lambda argv: "" if argv[1] == "requeue" else failed(
        "scontrol: error: Access/permission denied"))
    late = client.requeue(7, on_refused=lambda exc: pytest.fail("asked again"))
    assert late is not None and "permission denied" in late
    assert len(runner.calls) == 2
    plain, runner = client_answering()
    assert plain.requeue(7, begin_in_s=None) is None
    assert runner.argvs == [["scontrol", "requeue", "7"]]
    broken, _ = client_answering(lambda argv: failed("Invalid job id specified"))
    with pytest.raises(SlurmCommandError, match="scontrol requeue 7"):
        broken.requeue(7)


# ---- reservations -----------------------------------------------------------------------------

RESV_LINE = ("ReservationName=hpct_spares StartTime=2026-11-22T03:43:33 "
             "EndTime=2027-11-22T03:43:33 Duration=365-00:00:00 Nodes=n[1-2],n5 NodeCnt=3 "
             "Users=root Groups=(null) Accounts=(null)\n")


def test_reservation_nodes() -> None:
    client, runner = client_answering(lambda argv: RESV_LINE)
    assert client.reservation_nodes("hpct_spares") == ["n1", "n2", "n5"]
    assert runner.argvs == [["scontrol", "show", "reservation", "-o", "hpct_spares"]]
    gone, _ = client_answering(lambda argv: failed("Reservation hpct_spares not found"))
    assert gone.reservation_nodes("hpct_spares") is None
    broken, _ = client_answering(lambda argv: failed("Unable to contact slurm controller"))
    with pytest.raises(SlurmCommandError, match="scontrol show reservation -o hpct_spares"):
        broken.reservation_nodes("hpct_spares")


def test_reservation_changes() -> None:
    client, runner = client_answering()
    client.create_reservation("hpct_check", ["n3", "n1", "n3"], users="root,alice")
    client.update_reservation("hpct_spares", ["n1", "n2", "n4"])
    client.delete_reservation("hpct_spares")
    assert runner.argvs == [
        ["scontrol", "create", "reservation", "ReservationName=hpct_check", "StartTime=now",
         "Duration=infinite", "Users=root,alice", "Nodes=n3,n1"],
        ["scontrol", "update", "ReservationName=hpct_spares", "Nodes=n1,n2,n4"],
        ["scontrol", "delete", "ReservationName=hpct_spares"]]
    with pytest.raises(HpctError, match="needs at least one node"):
        client.create_reservation("r", [], users="root")
    with pytest.raises(HpctError, match="needs at least one node"):
        client.update_reservation("r", [])
    with pytest.raises(HpctError, match="reservation name 'a b' is not"):
        client.delete_reservation("a b")
    assert len(runner.calls) == 3


def test_the_spare_pool_lists_through_the_client() -> None:
    from hpct_slurm.spares.pool import FEATURE, SparePool

    sinfo = json.dumps({"nodes": [
        {"name": "n1", "state": "idle", "features": FEATURE, "comment": "hpct: spare pool add"},
        {"name": "n2", "state": "idle", "state_flags": ["DRAIN"], "reason": "hpct: x"},
        {"name": "n5", "state": "idle"}]})
    client, runner = client_answering(lambda argv: sinfo if argv[0] == "sinfo" else RESV_LINE)
    listed = SparePool(client).list()
    assert [(p.name, p.state, p.labelled, p.comment) for p in listed] == [
        ("n1", "IDLE", True, "hpct: spare pool add"), ("n2", "DRAINED", False, None),
        ("n5", "IDLE", False, None)]
    assert runner.argvs == [["sinfo", "--json"],
                            ["scontrol", "show", "reservation", "-o", "hpct_spares"]]


# ---- the rest: node states, ping, scancel, srun --------------------------------------------------

def test_node_states() -> None:
    client, runner = client_answering(lambda argv: "n1 idle\nn2 down*\nn2 down*\n\n")
    assert client.node_states() == {"n1": "idle", "n2": "down*"}
    assert runner.argvs == [["sinfo", "-h", "-N", "-o", "%N %T"]]
    with pytest.raises(HpctError, match="is not 'NODE STATE'"):
        parse_node_states("n1 idle extra\n")


def test_ping() -> None:
    up, runner = client_answering(lambda argv: "Slurmctld(primary) at c is UP\n")
    assert up.ping() is True
    assert runner.argvs == [["scontrol", "ping"]] and runner.calls[0][1]["timeout"] == 10
    assert client_answering(lambda argv: failed("DOWN"))[0].ping() is False
    assert client_answering(lambda argv: subprocess.TimeoutExpired(argv, 10))[0].ping() is False
    with pytest.raises(SlurmCommandError, match="not installed"):
        client_answering(lambda argv: FileNotFoundError(argv[0]))[0].ping()


def test_cancel_user_and_reconfigure() -> None:
    client, runner = client_answering()
    client.cancel_user("root")
    client.reconfigure()
    assert runner.argvs == [["scancel", "--full", "--user", "root"], ["scontrol", "reconfigure"]]
    with pytest.raises(HpctError, match="is not a user name"):
        client.cancel_user("--everyone")


def test_srun_on_one_node_captures_and_raises() -> None:
    client, runner = client_answering(
        lambda argv: failed("srun: error: Unable to allocate resources: Requested node "
                            "configuration is not available"))
    with pytest.raises(SlurmCommandError) as err:
        client.srun("n3", ["true"], options=["--reservation=hpct_check", "--immediate=10"],
                    timeout=60)
    assert "Requested node configuration" in err.value.stderr
    [(argv, kw)] = runner.calls
    assert argv == ["srun", "-N1", "-n1", "-w", "n3", "--reservation=hpct_check",
                    "--immediate=10", "true"]
    assert kw["timeout"] == 60


def test_run_step_over_nodes_returns_the_exit_code() -> None:
    client, runner = client_answering(
        lambda argv: subprocess.CompletedProcess(argv, 3, stdout=None, stderr=None))
    assert client.run_step(["n1", "n2"], ["python", "-m", "x"], options=["-K1"]) == 3
    [(argv, kw)] = runner.calls
    assert argv == ["srun", "-N2", "-n2", "--ntasks-per-node=1", "-w", "n1,n2", "-K1",
                    "python", "-m", "x"]
    assert kw["stdin"] == subprocess.DEVNULL and "capture_output" not in kw
    assert "timeout" not in kw  # a training step has no time limit of ours
    for nodes, argv in (([], ["x"]), (["n[1-2]"], ["x"]), (["n1"], [])):
        with pytest.raises(HpctError):
            srun_nodes_argv(nodes, argv)


def test_localcluster_client_is_bound_to_its_cluster(tmp_path: Path, monkeypatch) -> None:
    from hpct_slurm.localcluster import LocalCluster

    monkeypatch.setenv("SLURM_JOB_ID", "5")
    cluster = LocalCluster(tmp_path, nodes=2, mode="ports")
    env = cluster.client().environ()
    assert env["SLURM_CONF"] == str(cluster.conf_path) and "SLURM_JOB_ID" not in env
