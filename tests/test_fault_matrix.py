"""The controller's fault matrix on the real local cluster (issue 5). Every case ends with
training bit-identical to an uninterrupted run of the same world size and seed."""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, UNPACED, bitwise_equal, collect,
                                          controller_events, last_step, release_requeued,
                                          release_when_pending, rank_events, recomputed_steps,
                                          step_events, submit, wait_job, wait_step)

pytestmark = pytest.mark.cluster
STEPS = 40
TRAIN = [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(STEPS),
         "--step-sleep", "0.1"]
_references: dict[tuple, dict] = {}


@pytest.fixture
def reference(cluster, tmp_path_factory):
    def get(active: int, extra: tuple[str, ...] = ()) -> dict:
        key = (active, extra)
        if key not in _references:
            d = tmp_path_factory.mktemp(f"reference{active}")
            jid = submit(cluster, d, TEMPLATE, [*TRAIN, *extra, *UNPACED], nodes=active,
                         env={"HPCT_ACTIVE_NODES": str(active)})
            wait_job(cluster, jid, d, 240, label=f"reference{active}")
            _references[key] = collect(d, active)
        return _references[key]
    return get


def _pid_of(run_dir: Path, node: str) -> int:
    return [e["pid"] for e in controller_events(run_dir)
            if e["event"] == "rank.register" and e["node"] == node][-1]


def _start(cluster, tmp_path, active=4, nodes=5):
    # disk persistence every 10 steps (the default is 500): the requeue tests resume from a
    # persisted step within these 40-step jobs
    return submit(cluster, tmp_path, TEMPLATE, TRAIN, nodes=nodes,
                  env={"HPCT_ACTIVE_NODES": str(active), "HPCT_PERSIST_EVERY": "10"})


def _fenced(run_dir: Path) -> dict[str, str]:
    return {e["node"]: e["how"] for e in controller_events(run_dir) if e["event"] == "fault.fenced"}


def test_scontrol_down_and_bad_messages_are_rejected(cluster, reference, tmp_path):
    ref = reference(4)
    jid = _start(cluster, tmp_path)
    wait_step(tmp_path, 10)
    start = [e for e in controller_events(tmp_path) if e["event"] == "controller.start"][0]
    host, port = start["address"].rsplit(":", 1)
    # from inside another node: garbage, a frame signed with the wrong secret, a truncated one
    probe = ("import socket,sys,json\n"
             "from hpct_slurm import protocol as P\n"
             "h,p=sys.argv[1],int(sys.argv[2])\n"
             "frames=[b'\\x00\\x00\\x00\\x05hello', P.encode(P.Register('x','n2',0,'active',1,"
             "'1.2.3.4',1), b'0'*32, 1, sys.argv[3]), b'\\xff\\xff\\xff\\xff']\n"
             "for f in frames:\n"
             "  s=socket.create_connection((h,p)); s.sendall(f); s.close()\n")
    out = cluster.run([sys.executable, "-c", probe, host, port, str(jid)], node="n2",
                      env={"PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    cluster.run(["scontrol", "update", "NodeName=n3", "State=DOWN", "Reason=test: admin down"],
                check=True)
    wait_job(cluster, jid, tmp_path, 240, label="scontrol-down")
    assert bitwise_equal(ref, collect(tmp_path, 4), tmp_path)
    assert recomputed_steps(tmp_path) == 0
    evs = controller_events(tmp_path)
    rejected = [e for e in evs if e["event"] == "protocol.rejected"]
    assert len(rejected) >= 3
    assert any("MAC" in e["error"] or "mac" in e["error"].lower() for e in rejected)
    assert [e["taken"] for e in evs if e["event"] == "recovery.done"] == [{"n3": "n5"}]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_sigstop_hang_is_fenced_and_a_stale_rank_resumed_later_changes_nothing(
        cluster, reference, tmp_path):
    """A hung node (SIGSTOP) is found by its missing heartbeats, fenced and replaced. Issue 30:
    n2's whole step is stopped (its slurmstepd and its rank), so the fence's cancel cannot land
    (scancel waits on the stopped slurmstepd) and the round goes on without it. The rank is resumed once the next generation trains: it still believes in generation
    0, its peers' ends of its connections are cut, its controller link is closed. It must
    leave without changing anything: no second fault, no second round, no rollback, training
    bit-identical."""
    ref = reference(4)
    jid = _start(cluster, tmp_path)
    wait_step(tmp_path, 10)
    rank_pid = _pid_of(tmp_path, "n2")
    stepd = _parent(rank_pid)
    with open(f"/proc/{stepd}/cmdline", "rb") as f:
        assert b"slurmstepd" in f.read(), "the rank's parent is not its slurmstepd"
    os.kill(stepd, signal.SIGSTOP)
    os.kill(rank_pid, signal.SIGSTOP)
    resumed_at = None
    try:
        deadline = time.monotonic() + 120
        while not [e for e in controller_events(tmp_path) if e["event"] == "recovery.done"]:
            assert time.monotonic() < deadline, "no recovery while n2's step was stopped"
            time.sleep(0.1)
        done = [e for e in controller_events(tmp_path) if e["event"] == "recovery.done"][0]
        # the new generation trains a few steps past its restore step, then the stale rank runs
        wait_step(tmp_path, last_step(tmp_path) + 3)
        resumed_at = time.time()
        os.kill(rank_pid, signal.SIGCONT)
        time.sleep(4.0)  # the stale rank's own time: collectives fail, link closed, leaving
    finally:
        for pid in (rank_pid, stepd):  # the cancel lands once slurmstepd runs again
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    wait_job(cluster, jid, tmp_path, 240, label="stale-rank")
    assert bitwise_equal(ref, collect(tmp_path, 4), tmp_path)
    assert recomputed_steps(tmp_path) == 0
    evs = controller_events(tmp_path)
    assert done["taken"] == {"n2": "n5"}
    assert [e["taken"] for e in evs if e["event"] == "recovery.done"] == [{"n2": "n5"}]
    faults = [e for e in evs if e["event"] == "fault.detected"]
    assert [e["node"] for e in faults] == ["n2"]
    assert faults[0]["reason"].startswith("no heartbeat")
    assert _fenced(tmp_path)["n2"] == "step cancelled"
    assert not [e for e in evs if e["event"].startswith("escalate.")]
    # the stale process really ran after it was resumed (else this proves nothing), and
    # reported nothing the new generation took: it ended in generation 0
    stale = [e for e in rank_events(tmp_path, "n2") if e["t"] > resumed_at]
    assert stale, "the stopped rank never ran again after SIGCONT"
    assert all(e.get("generation", 0) == 0 for e in stale), stale


def test_cut_link_partitioned_node_is_downed(cluster, reference, tmp_path):
    ref = reference(4)
    jid = _start(cluster, tmp_path)
    wait_step(tmp_path, 10)
    cluster.cut_link("n3")
    try:
        wait_job(cluster, jid, tmp_path, 240, label="cut-link")
    finally:
        cluster.cut_link("n3", up=True)
    assert bitwise_equal(ref, collect(tmp_path, 4), tmp_path)
    assert recomputed_steps(tmp_path) == 0
    assert _fenced(tmp_path)["n3"] == "node down"
    assert cluster.client().show_node("n3").reason.startswith("hpct:")
    # Issue 19: a partitioned peer sends no FIN, so survivors blocked in a collective with it
    # were held until the 10 s collective timeout (7 s of survivors_ready). The STOP names the
    # lost address and survivors cut their own connections to it: they are ready at once.
    done = [e for e in controller_events(tmp_path) if e["event"] == "recovery.done"]
    assert len(done) == 1 and done[0]["phases"]["survivors_ready"] < 5.0, done
    severed = [e for n in ("n1", "n2", "n4") for e in rank_events(tmp_path, n)
               if e["event"] == "rank.severed"]
    assert severed


# 25.6 MB of state (parameters + Adam's moments): 4 stripes of a striped pull (8 MB each).
# Its compute (~0.2 s a step with 3 ranks here) stands in for the step sleep; 24 steps leave
# 10 after the last fault of the tests that use it.
BIG = ("--steps", "24", "--hidden", "1024", "--layers", "3", "--step-sleep", "0")


def _registered(run_dir: Path, node: str) -> dict:
    return [e for e in controller_events(run_dir)
            if e["event"] == "rank.register" and e["node"] == node][-1]


def _connections(pid: int) -> list[tuple[str, int, str, int, str]]:
    """The TCP connections in `pid`'s network namespace (a node's): (local ip, port, remote
    ip, port, state) from the kernel's table, whatever that process is doing (even stopped)."""
    def addr(field: str) -> tuple[str, int]:
        ip, port = field.split(":")
        return socket.inet_ntoa(bytes.fromhex(ip)[::-1]), int(port, 16)
    rows = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    return [(*addr(f[1]), *addr(f[2]), f[3]) for f in (r.split() for r in rows)]


def test_second_fault_during_recovery_a_source_dies_mid_pull(cluster, reference, tmp_path):
    """Issue 15.4: another node dies before the group re-forms, while the replacement pulls
    its state from it. n3 crashes; the spare that takes rank 2 pulls the state striped from n1
    and n2; n2 dies with a stripe of that pull in flight. The pull finishes from n1 alone
    (transfer.source_dropped names n2), the group cannot form without n2, and a second round
    at the same restore step gives n2's position to the other spare: no restart, no requeue,
    bit-identical, nothing recomputed.

    The moment is made certain, not lucky: both spares are SIGSTOPped before the crash (no
    pull can start before the test lets it), n2 is SIGSTOPped once the assignment is out (the
    kernel still accepts a connection to its transfer server, which answers nothing: the
    stripe asked of it stays in flight and the pull cannot end), the spares go on, and n2 is
    killed once the taker's connection to n2's transfer server is seen in n2's TCP table."""
    ref = reference(3, BIG)
    jid = submit(cluster, tmp_path, TEMPLATE, [*TRAIN, *BIG], nodes=5,
                 env={"HPCT_ACTIVE_NODES": "3"})
    wait_step(tmp_path, 10)
    spares = {n: _registered(tmp_path, n)["pid"] for n in ("n4", "n5")}
    for pid in spares.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        cluster.kill_node("n3")
        deadline = time.monotonic() + 60
        while not (assigns := [e for e in controller_events(tmp_path)
                               if e["event"] == "recovery.assign"]):
            assert time.monotonic() < deadline, "no recovery.assign for n3's loss"
            time.sleep(0.005)
        n2 = _registered(tmp_path, "n2")
        os.kill(n2["pid"], signal.SIGSTOP)
    finally:
        for pid in spares.values():
            os.kill(pid, signal.SIGCONT)
    taker = assigns[0]["taken"]["n3"]
    other = ({"n4", "n5"} - {taker}).pop()
    host, port = n2["transfer"].rsplit(":", 1)
    taker_host = _registered(tmp_path, taker)["transfer"].rsplit(":", 1)[0]
    deadline = time.monotonic() + 60
    while not [c for c in _connections(n2["pid"])
               if c[:2] == (host, int(port)) and c[2] == taker_host and c[4] == "01"]:
        assert time.monotonic() < deadline, f"{taker} never connected to n2's transfer server"
        time.sleep(0.005)
    t_kill = time.time()
    cluster.kill_node("n2")
    wait_job(cluster, jid, tmp_path, 240, label="source-dies-mid-pull")

    got = collect(tmp_path, 3)
    assert bitwise_equal(ref, got, tmp_path)
    assert recomputed_steps(tmp_path) == 0
    assert (got[1]["node"], got[2]["node"]) == (other, taker)
    evs = controller_events(tmp_path)
    assert not [e for e in evs if e["event"].startswith("escalate.")]
    assert len([e for e in evs if e["event"] == "controller.start"]) == 1  # no requeue
    # two faults, the crash and the source; the spares' pause cost nothing
    assert {e["node"] for e in evs if e["event"] == "fault.detected"} == {"n3", "n2"}
    # a second round at the same restore step, with the other spare
    first, second = [e for e in evs if e["event"] == "recovery.assign"]
    assert second["taken"] == {"n2": other} and second["generation"] == first["generation"] + 1
    assert second["restore_step"] == first["restore_step"]
    # the kill landed mid-pull: the taker's pull of the first round lost n2 at a stripe and
    # got every byte from n1 after the kill
    restore = first["restore_step"]
    mine = rank_events(tmp_path, taker)
    [dropped] = [e for e in mine if e["event"] == "transfer.source_dropped"
                 and e["source"] == n2["transfer"]]
    assert dropped["step"] == restore
    assert "refused" not in dropped["error"].lower(), dropped  # a live connection, cut
    pulled = [e for e in mine if e["event"] == "transfer.striped"][0]
    n1 = _registered(tmp_path, "n1")["transfer"]
    assert pulled["step"] == restore and pulled["dropped"] == 1
    assert pulled["sources"] == {n1: pulled["nbytes"]} and pulled["nbytes"] > 16 * 2**20
    assert pulled["t"] > t_kill and dropped["t"] > t_kill


def test_spare_dies_before_it_is_used(cluster, reference, tmp_path):
    ref = reference(3, BIG)  # the reference of the test above: one run fewer
    jid = submit(cluster, tmp_path, TEMPLATE, [*TRAIN, *BIG], nodes=5,
                 env={"HPCT_ACTIVE_NODES": "3"})
    wait_step(tmp_path, 8)
    cluster.kill_node("n4")  # a spare
    wait_step(tmp_path, 14)
    cluster.kill_node("n3")
    wait_job(cluster, jid, tmp_path, 240, label="spare-dies")
    got = collect(tmp_path, 3)
    assert bitwise_equal(ref, got, tmp_path)
    assert recomputed_steps(tmp_path) == 0
    assert got[2]["node"] == "n5"
    spare_fault = [e for e in controller_events(tmp_path) if e["event"] == "fault.detected"][0]
    assert spare_fault["node"] == "n4" and spare_fault["role"] == "spare"


def test_no_spare_left_requeues_and_restores_from_disk(cluster, reference, tmp_path):
    ref = reference(4)
    jid = _start(cluster, tmp_path, active=4, nodes=4)
    wait_step(tmp_path, 25)
    # a node of the job's own (4 of the 5: Slurm 26.05 once gave n1,n2,n4,n5), not its batch
    # host
    [start] = [e for e in controller_events(tmp_path) if e["event"] == "controller.start"]
    victim = start["active"][2]
    cluster.kill_node(victim)
    release_requeued(cluster, jid, tmp_path)
    wait_job(cluster, jid, tmp_path, 300, label="no-spare")
    got = collect(tmp_path, 4)
    assert bitwise_equal(ref, got, tmp_path)
    evs = controller_events(tmp_path)
    assert any(e["event"] == "escalate.requeue" for e in evs)
    resumed = [e for e in evs if e["event"] == "controller.resume_from_disk"]
    assert resumed and resumed[0]["step"] >= 9  # a persisted snapshot, not step 0
    assert victim not in {r["node"] for r in got.values()}


def test_batch_host_loss_requeues_and_resumes(cluster, reference, tmp_path):
    """The batch host dies without a word (its link first, then every process: a power loss
    sends no FIN). Slurm keeps the --no-kill job RUNNING without its batch script, so the
    ranks must see their controller's connection fail on its own and requeue the job (CI once
    saw a plain kill end with every survivor waiting and the job never requeued)."""
    ref = reference(4)
    jid = _start(cluster, tmp_path, active=4, nodes="4-5")
    wait_step(tmp_path, 25)
    restarts = cluster.client().show_job(jid).restart_count
    cluster.cut_link("n1")  # the batch host
    cluster.kill_node("n1")
    # Slurm may hold the requeued job back (BeginTime, or held after a failed batch launch):
    # release it as an admin would, so the test measures our resume, not Slurm's hold.
    release_when_pending(cluster, jid, 180, after_restarts=restarts)
    wait_job(cluster, jid, tmp_path, 300, label="batch-host")
    got = collect(tmp_path, 4)
    assert bitwise_equal(ref, got, tmp_path)
    assert any(e["event"] == "rank.requeued_job" for e in rank_events(tmp_path))
    resumed = [e for e in controller_events(tmp_path) if e["event"] == "controller.resume_from_disk"]
    assert resumed and resumed[0]["step"] >= 9
    assert "n1" not in {r["node"] for r in got.values()}


def test_spare_borrowed_from_the_cluster_pool(cluster, reference, tmp_path):
    """More faults than the job reserved spares for: its spare comes from the cluster pool,
    through a companion job in the pool reservation (the pool template)."""
    from hpct_slurm.spares.pool import SparePool
    from hpct_slurm.templates.cli import TEMPLATES

    ref = reference(4)
    pool = SparePool(cluster.client())
    pool.add(["n5"])
    try:
        jid = submit(cluster, tmp_path, TEMPLATES / "pool.sbatch", TRAIN, nodes=4,
                     env={"HPCT_POOL_SPARES": "1"})
        deadline = time.monotonic() + 120
        while not any(e["event"] == "pool.spare_joined" for e in controller_events(tmp_path)):
            assert time.monotonic() < deadline, "the pool spare never joined"
            time.sleep(0.2)
        wait_step(tmp_path, 12)
        cluster.kill_node("n3")
        wait_job(cluster, jid, tmp_path, 240, label="pool-spare")
    finally:
        pool.remove(["n5"])
    got = collect(tmp_path, 4)
    assert bitwise_equal(ref, got, tmp_path)
    assert recomputed_steps(tmp_path) == 0
    assert got[2]["node"] == "n5"
    evs = controller_events(tmp_path)
    borrowed = [e for e in evs if e["event"] == "pool.borrow"]
    assert len(borrowed) == 1
    # the companion job ended with the training job
    state = cluster.run(["squeue", "-h", "-j", str(borrowed[0]["companion_job"])]).stdout
    assert state.strip() == ""


def test_no_spare_left_shrinks_with_the_same_global_batch(cluster, reference, tmp_path):
    """Policy shrink: the survivors take over the lost node's data shard (gradient
    accumulation), so every step still consumes all 4 shards of the original world."""
    ref = reference(4)
    jid = submit(cluster, tmp_path, TEMPLATE, [*TRAIN, "--micro"], nodes=4,
                 env={"HPCT_ACTIVE_NODES": "4", "HPCT_ON_NO_SPARE": "shrink"})
    wait_step(tmp_path, 12)
    cluster.kill_node("n3")
    wait_job(cluster, jid, tmp_path, 240, label="shrink")
    got = collect(tmp_path, 3)
    evs = controller_events(tmp_path)
    shrunk = [e for e in evs if e["event"] == "recovery.shrink"]
    assert len(shrunk) == 1 and shrunk[0]["members"] == ["n1", "n2", "n4"]
    restore = [e for e in evs if e["event"] == "recovery.assign"][0]["restore_step"]
    # before the fault the micro-step path is bit-identical to the reference...
    for step in range(restore + 1):
        assert got[0]["losses"][str(step)] == ref[0]["losses"][str(step)]
    # ...after it, every step still covers every data shard of the original world
    after = [e for e in step_events(tmp_path) if e["step"] > restore + 1]
    by_step: dict[int, list[int]] = {}
    for e in after:
        by_step.setdefault(e["step"], []).extend(e["data_ranks"])
    assert by_step and all(sorted(v) == [0, 1, 2, 3] for v in by_step.values())
    # the same global batch: training lands where the uninterrupted run does, up to the
    # float summation order of the accumulation
    assert abs(got[0]["losses"][str(STEPS - 1)] - ref[0]["losses"][str(STEPS - 1)]) < 1e-3 * \
        max(1.0, abs(ref[0]["losses"][str(STEPS - 1)]))


def test_rank_reported_fault_restarts_in_place(cluster, reference, tmp_path):
    """A rank whose step raises (the process stays healthy) tells the controller it is ready:
    every rank restarts in place under a new generation, nobody is replaced, nothing is lost."""
    ref = reference(4)
    jid = submit(cluster, tmp_path, TEMPLATE, [*TRAIN, "--fail-at", "15", "--fault-rank", "1"],
                 nodes=5, env={"HPCT_ACTIVE_NODES": "4"})
    wait_job(cluster, jid, tmp_path, 240, label="in-process")
    got = collect(tmp_path, 4)
    assert bitwise_equal(ref, got, tmp_path)
    assert recomputed_steps(tmp_path) == 0
    evs = controller_events(tmp_path)
    assert [e["nodes"] for e in evs if e["event"] == "fault.in_process"] == [["n2"]]
    assert [e["taken"] for e in evs if e["event"] == "recovery.done"] == [{}]
    assert not _fenced(tmp_path)
    # the same four processes trained to the end: one registration per active node
    registered = [e["node"] for e in evs if e["event"] == "rank.register"]
    assert sorted(registered) == ["n1", "n2", "n3", "n4", "n5"]
    assert {r["node"] for r in got.values()} == {"n1", "n2", "n3", "n4"}


def test_hung_training_thread_is_found_by_missing_progress(cluster, reference, tmp_path):
    """The training thread deadlocks while the process (and its heartbeat thread) lives on:
    no step completes, the controller fences the rank and a warm spare takes over."""
    ref = reference(4)
    jid = submit(cluster, tmp_path, TEMPLATE, [*TRAIN, "--hang-at", "15", "--fault-rank", "2"],
                 nodes=5, env={"HPCT_ACTIVE_NODES": "4", "HPCT_PROGRESS_TIMEOUT_S": "4"})
    wait_job(cluster, jid, tmp_path, 240, label="hung-thread")
    _assert_n3_replaced(ref, tmp_path, "no progress", "step cancelled")


def test_a_dead_slurmd_is_seen_in_slurm_state_and_the_rank_moves(cluster, reference, tmp_path):
    """Only n3's slurmd dies: its rank trains on and answers heartbeats, but Slurm marks the
    node NOT_RESPONDING; the controller's throttled poll of Slurm's node states sees it, downs
    the node and moves its rank to the spare."""
    ref = reference(4)
    # slower steps until the fault (the same results): Slurm needs SlurmdTimeout (6 s) and a
    # ping to notice
    jid = submit(cluster, tmp_path, TEMPLATE,
                 [*TRAIN, "--step-sleep", "0.8", "--later-step-sleep", "0.1"], nodes=5,
                 env={"HPCT_ACTIVE_NODES": "4"})
    wait_step(tmp_path, 3)
    os.kill(cluster.state().slurmd_pids["n3"], signal.SIGKILL)
    wait_job(cluster, jid, tmp_path, 240, label="slurmd-death")
    _assert_n3_replaced(ref, tmp_path, "slurm: node not responding", "node down")


def _assert_n3_replaced(ref: dict, run_dir: Path, reason: str, fenced_how: str) -> None:
    """n3 was the first fault (for `reason`), fenced that way, and n5 finished its rank, with
    training bit-identical to the reference and nothing recomputed."""
    got = collect(run_dir, 4)
    assert bitwise_equal(ref, got, run_dir)
    assert recomputed_steps(run_dir) == 0
    faults = [e for e in controller_events(run_dir) if e["event"] == "fault.detected"]
    assert faults[0]["node"] == "n3" and faults[0]["reason"].startswith(reason)
    assert _fenced(run_dir)["n3"] == fenced_how and got[2]["node"] == "n5"
