"""Escalations and the job's record (issue 30, section 2 "Every escalation waits 6 s for the job
Comment", "A requeued job sits PENDING for its BeginTime", "Records", and section 3's record
that a tab, newline or bidi character lost): the requeue never waits for the Slurm comment,
the requeued job is eligible again within seconds instead of Slurm's two-minute hold, the
comment is cleaned rather than dropped, a round cut short by another fault stays in the
record, and a crashed rank's connection reset is a lost connection, not a rejected stranger.

The controller runs with test_controller_fast's in-process fakes; Slurm is a stand-in runner.
Whether Slurm 22.05 itself starts a requeued job at the StartTime set is a cluster test
(tests/test_slurm_client_cluster.py)."""
from __future__ import annotations

import asyncio
import signal
import socket
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hpct_slurm.controller import lifecycle as L
from hpct_slurm.controller.lifecycle import Lifecycle, Tally, fold, summary
from hpct_slurm.controller.policy import RecoveryRecord
from hpct_slurm.events import EventLog, read_events
from hpct_slurm.fault_count import CountingLog
from hpct_slurm.slurm.client import (REQUEUE_BEGIN_S, SlurmClient, printable_line,
                                     sigterm_ignored)
from hpct_slurm.slurm.env import SlurmEnv
from test_controller_fast import JOB, FakeCluster, run

REFUSED = ("Job update not available right now, the DB index is being set, try again in a "
           "bit for job 4242\n")


def refused(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(argv, 1, stdout="", stderr=REFUSED)


def ok(argv: list[str], out: str = "") -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(argv, 0, stdout=out, stderr="")


# ---- 1. the record never holds up the requeue -----------------------------------------------

def test_the_requeue_does_not_wait_for_a_comment_slurm_keeps_refusing(tmp_path):
    """Slurm answers each comment update after 1.5 s with "try again" (slurmctld waits for the
    DB index itself): the requeue goes out at once all the same, the job is made eligible
    right after it, and the run ends within COMMENT_WAIT_S of it."""
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1"], spares=0) as c:
            c.comment_refusals, c.comment_delay_s = 100, 1.5
            await c.started()
            await c.train(["localhost", "a1"], 2)
            await c.crash("a1")
            assert await asyncio.wait_for(asyncio.shield(c.job), 8) == 75
            [failed], [requeue] = c.events("recovery.failed"), c.events("escalate.requeue")
            assert requeue["t"] - failed["t"] < 0.5, "the requeue waited for the comment"
            # (the comment's own update, on its thread, may come between the two: the
            # requeue's record, escalate.requeued, is written between them)
            argvs = [a for a in c.runner.argvs if a[:2] in (["scontrol", "requeue"],
                                                            ["scontrol", "update"])
                     and not a[-1].startswith("Comment=")]
            first_requeue = argvs.index(["scontrol", "requeue", str(JOB)])
            assert argvs[first_requeue + 1] == ["scontrol", "update", f"JobId={JOB}",
                                                f"StartTime=now+{REQUEUE_BEGIN_S}"]
            [eligible] = c.events("escalate.eligible")
            assert eligible["begin_in_s"] == REQUEUE_BEGIN_S
            [exit_] = c.events("controller.exit")
            assert exit_["t"] - requeue["t"] < L.COMMENT_WAIT_S + 1.0
            assert c.comments == []  # Slurm never took it: the events say so
            assert [e["comment_try"] for e in c.events("slurm.error") if "comment_try" in e]
    run(scenario)


class Host(SimpleNamespace):
    """What Lifecycle's record uses of the controller: its Slurm client, events, job id."""


def lifecycle(tmp_path, answer) -> tuple[Lifecycle, list[list[str]]]:
    argvs: list[list[str]] = []

    def runner(argv, **kw):
        argvs.append(list(argv))
        return answer(list(argv))

    host = Host(slurm=SlurmClient(runner=runner), o=SimpleNamespace(job_id=JOB),
                events=CountingLog(tmp_path / "controller.jsonl", source="controller"))
    return Lifecycle(host), argvs  # type: ignore[arg-type]


def slurm_errors(tmp_path) -> list[dict]:
    return [e for e in read_events(tmp_path / "controller.jsonl") if e["event"] == "slurm.error"]


def test_a_refused_comment_is_tried_again_a_bounded_number_of_times_with_an_event_each(
        tmp_path, monkeypatch):
    monkeypatch.setattr(L, "COMMENT_TRIES", 3)
    monkeypatch.setattr(L, "COMMENT_PAUSE_S", 0.01)

    async def scenario():
        life, argvs = lifecycle(tmp_path, refused)
        life.record("requeued: infrastructure: x")
        await asyncio.wait_for(life.comment_task, 5)
        assert len(argvs) == 3
        assert [(e["comment_try"], e["again_in_s"]) for e in slurm_errors(tmp_path)] == [
            (1, 0.01), (2, 0.01), (3, None)]
    asyncio.run(scenario())


def test_a_comment_refused_for_another_reason_is_not_asked_again(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "COMMENT_PAUSE_S", 0.01)

    async def scenario():
        life, argvs = lifecycle(tmp_path, lambda argv: subprocess.CompletedProcess(
            argv, 1, stdout="", stderr="Access/permission denied\n"))
        life.record()
        await asyncio.wait_for(life.comment_task, 5)
        assert len(argvs) == 1
        [err] = slurm_errors(tmp_path)
        assert "permission denied" in err["error"] and err["again_in_s"] is None
    asyncio.run(scenario())


# ---- 2. a requeued job is eligible within seconds ------------------------------------------
# (SlurmClient.requeue's commands: tests/test_slurm_door.py)

def test_sigterm_is_ignored_meanwhile_by_this_process_and_the_commands_it_starts():
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_ignored():
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        child = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal("
                                "signal.SIGTERM) == signal.SIG_IGN)"],
                               capture_output=True, text=True, timeout=30)
    assert child.stdout.strip() == "True"
    assert signal.getsignal(signal.SIGTERM) == before


TASK = {"SLURM_JOB_ID": "28017", "SLURM_JOB_NODELIST": "localhost",
        "SLURMD_NODENAME": "localhost", "SLURM_STEP_NODELIST": "localhost",
        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
        "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"}


def test_a_rank_that_requeues_after_the_batch_host_died_makes_the_job_eligible_at_once(
        tmp_path):
    from hpct_slurm.recovery.controller_loss import ControllerLoss

    seen: list[tuple[list[str], bool]] = []  # each command, and whether SIGTERM was ignored

    def runner(argv, **kw):
        seen.append((list(argv), signal.getsignal(signal.SIGTERM) == signal.SIG_IGN))
        if argv[:3] == ["scontrol", "show", "job"]:
            return ok(argv, "JobId=28017 JobName=train UserId=u(1) JobState=RUNNING "
                            "Restarts=0 ExitCode=0:0 NodeList=n[1-2]\n")
        return ok(argv)

    events = EventLog(tmp_path / "rank.jsonl", source="rank")
    loss = ControllerLoss("127.0.0.1:9", SlurmEnv.from_environ(TASK), events,
                          SimpleNamespace(rank=0), lambda: SlurmClient(runner=runner))
    loss.requeue()
    assert seen[1:] == [(["scontrol", "requeue", "28017"], True),
                        (["scontrol", "update", "JobId=28017",
                          f"StartTime=now+{REQUEUE_BEGIN_S}"], True)]
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN  # given back
    records = list(read_events(tmp_path / "rank.jsonl"))
    # the requeue's record first, written before the update that KillWait may cut short
    assert [e["event"] for e in records] == ["rank.requeued_job", "rank.requeue_begin"]
    assert records[1]["begin_in_s"] == REQUEUE_BEGIN_S


# ---- 3. the record is cleaned, not dropped ------------------------------------------------

def test_a_record_with_a_tab_a_newline_or_a_bidi_control_is_cleaned_not_dropped():
    assert printable_line("a\tb\nc\r\u2028d") == "a b c  d"
    assert printable_line("x\u202ey\u2066z\u2069\x00\x7f\u200b!") == "x?y?z????!"
    text = summary(Tally(faults=1), "failed, not requeued: the script's own error: "
                                    "Bad\tvalue\nat \u202elin\u202c 3")
    assert text.endswith("error: Bad value at ?lin? 3")
    SlurmClient(runner=lambda argv, **kw: ok(argv)).set_job_comment(1, text)  # taken


def test_an_escalation_whose_reason_holds_control_characters_is_still_recorded(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1"], spares=0) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            await c.ctl._escalate("RuntimeError: bad\tinput\n\u202eevil\u2069 line",
                                  script=True)
            await c.until(lambda: c.comments, "the comment")
            assert c.comments[-1].endswith(
                "failed, not requeued: the script's own error: RuntimeError: bad input ?evil? "
                "line")
    run(scenario)


# ---- 4. every fault in the record, each with its cause --------------------------------------

def test_fold_keeps_the_round_cut_short_in_the_one_that_follows():
    earlier = RecoveryRecord(t_detect=10.0, generation=1, restore_step=3, lost=["n3"],
                             taken={"n3": "n5"}, reasons={"n3": "connection lost"},
                             newest_done=5)
    rec = RecoveryRecord(t_detect=12.0, generation=2, restore_step=3, lost=["n5"],
                         taken={"n5": "n6"}, reasons={"n5": "step exited (1)"}, newest_done=-1)
    fold(earlier, rec)
    assert rec.lost == ["n3", "n5"] and rec.taken == {"n3": "n5", "n5": "n6"}
    assert rec.reasons == {"n3": "connection lost", "n5": "step exited (1)"}
    assert (rec.t_detect, rec.newest_done, rec.generation) == (10.0, 5, 2)


def test_a_round_cut_short_by_a_second_fault_is_in_recovery_done_and_the_comment(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1", "s2"], spares=2) as c:
            await c.started()
            await c.train(["localhost", "a1", "a2"], 3)
            await c.crash("a1")
            await c.assigned("s1", 1)
            await c.crash("s1")  # the taker dies before the new generation's first step
            await c.assigned("s2", 2)
            await c.train(["localhost", "s2", "a2"], 4)
            [done] = await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert done["lost"] == ["a1", "s1"]
            assert done["taken"] == {"a1": "s1", "s1": "s2"}
            assert sorted(done["reasons"]) == ["a1", "s1"] and all(done["reasons"].values())
            [first] = [e for e in c.events("fault.detected") if e["node"] == "a1"]
            assert done["t"] - done["recovery_s"] == pytest.approx(first["t"], abs=0.05)
            await c.until(lambda: c.comments, "the comment")
            assert c.comments[-1].startswith("hpct: 2 fault(s), 0 move(s), replaced a1>s1 "
                                             "s1>s2, pause ")
            assert await c.finish() == 0
    run(scenario)


def test_a_round_cut_short_by_an_escalation_is_in_the_comment(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 3)
            await c.crash("a1")
            await c.assigned("s1", 1)
            await c.crash("s1")  # no spare left: requeued
            assert await asyncio.wait_for(asyncio.shield(c.job), 8) == 75
            await c.until(lambda: c.comments, "the comment")
            text = c.comments[-1]
            # two nodes lost, two faults (issue 45.4: as `status` lists them)
            assert text.startswith("hpct: 2 fault(s), 0 move(s), replaced a1>s1, pause "), text
            assert "requeued: infrastructure: 1 node(s) lost (s1)" in text
    run(scenario)


def test_a_crashed_ranks_connection_reset_is_a_lost_connection_not_a_rejected_stranger(
        tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            # its process dies with SO_LINGER 0 (or unread data): the connection is reset
            # (RST), as a crashed process's often is, rather than closed
            sock = c.rank("a1").writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await c.crash("a1", step_exit_after_s=0.3)  # its step's exit comes later
            await c.assigned("s1", 1)
            [lost] = c.events("connection.lost")
            assert (lost["node"], lost["local_rank"]) == ("a1", 0)
            assert "reset" in lost["error"].lower()
            assert c.events("protocol.rejected") == []
            [fault] = c.events("fault.detected")
            assert (fault["node"], fault["reason"]) == ("a1", "connection lost")
    run(scenario)
