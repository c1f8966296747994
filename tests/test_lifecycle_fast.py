"""The node lifecycle (issue 17) against the real Controller with in-process fake ranks
(test_controller_fast's FakeCluster): planned moves off a drained node, growing back after a
shrink, the job's Slurm comment; and the pure rules behind them."""
from __future__ import annotations

import asyncio

import pytest

from hpct_slurm.controller.lifecycle import Tally, drained, moved_reason, summary
from hpct_slurm.controller.policy import World, decide_grow, grow, shrink
from hpct_slurm.errors import HpctError
from hpct_slurm.slurm.client import NodeInfo, SlurmClient
from test_controller_fast import FakeCluster, run


def node(name: str, state: str, reason: str | None = None) -> NodeInfo:
    from hpct_slurm.slurm.client import parse_node_state
    base, flags = parse_node_state(state)
    return NodeInfo(name=name, state=base, flags=flags, reason=reason, addr=None, hostname=None,
                    features=(), active_features=())


# ---- pure rules ----------------------------------------------------------------------------------

def test_only_drained_members_that_still_run_are_moved():
    nodes = [node("a1", "ALLOCATED+DRAIN", "bad fan"), node("a2", "ALLOCATED"),
             node("a3", "DOWN+DRAIN", "dead"), node("s1", "IDLE+DRAIN", "spare")]
    assert drained(nodes, ["a1", "a2", "a3"]) == [("a1", "bad fan")]


def test_the_moved_reason_keeps_the_admins_and_is_appended_once():
    once = moved_reason("bad fan", "s1", 7)
    assert once == "bad fan; hpct: job 7 moved its ranks to s1"
    assert moved_reason(once, "s1", 7) == once
    assert moved_reason(None, "s1", 7).startswith("drained; hpct:")


def test_the_summary_is_one_short_line_without_key_value_pairs():
    t = Tally(faults=1, moves=2, replaced=["n3>n5", "n2>n6"], pause_s=1.234, lost_steps=0)
    text = summary(t, "requeued: infrastructure: x=y")
    assert text == ("hpct: 1 fault(s), 2 move(s), replaced n3>n5 n2>n6, pause 1.23s, "
                    "lost steps 0, requeued: infrastructure: x:y")
    long = summary(Tally(replaced=[f"n{i}>m{i}" for i in range(100)]))
    assert len(long) == 250 and long.endswith("...")


def test_grow_gives_each_spare_back_one_shard_and_restores_the_original_order():
    w = World(["a", "b", "c", "d"], [], 1)
    rep, shards = shrink(w, ["b", "c"], {n: [i] for i, n in enumerate(w.members)})
    assert shards == {"a": [0, 1], "d": [3, 2]}
    shrunk = World(rep.members, ["s"], 1, generation=1)
    rep2, back = grow(shrunk, shards, ["s"])
    assert back == {"a": [0], "s": [1], "d": [3, 2]}
    assert rep2.members == ["a", "s", "d"] and rep2.generation == 2 and rep2.spares == []
    assert grow(World(["a", "s", "d"], [], 1), back, []) is None  # no spare: nothing to do
    assert grow(World(["a", "b"], ["s"], 1), {"a": [0], "b": [1]}, ["s"]) is None  # never shrank


def test_grow_refuses_per_rank_state():
    from hpct_slurm.controller.policy import Held, SurvivorReport
    w = World(["a"], ["s"], 1, generation=1)
    reports = [SurvivorReport("a", 0, Held(frozenset({5})), 0, rank_state=True)]
    assert decide_grow(w, {"a": [0, 1]}, ["s"], reports) is None
    plain = [SurvivorReport("a", 0, Held(frozenset({5})), 0)]
    d = decide_grow(w, {"a": [0, 1]}, ["s"], plain)
    assert d is not None and d.plan.step == 5 and d.plan.sources == {0: "own", 1: "peer"}


def test_slurm_client_refuses_a_bad_comment_and_reboot():
    c = SlurmClient(runner=lambda argv, **kw: pytest.fail(f"ran {argv}"))
    with pytest.raises(HpctError, match="job comment"):
        c.set_job_comment(1, "two\nlines")
    with pytest.raises(HpctError, match="over 250"):
        c.set_job_comment(1, "x" * 251)
    with pytest.raises(HpctError, match="next state"):
        c.reboot_nodes("n1", "hpct: x", next_state="IDLE")


# ---- the controller ------------------------------------------------------------------------------

def test_a_drained_member_moves_to_the_spare_with_no_fault_and_no_lost_step(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 4)
            c.state["a1"], c.reason["a1"] = "ALLOCATED+DRAIN", "new DIMM"

            a = await c.assigned("s1", 1)
            assert (a.rank, a.world_size, a.restore_step) == (1, 2, 4)
            assert a.members == ["localhost", "s1"]
            leaving, lh = c.rank("a1"), c.rank("localhost")
            # the leaving rank is the first source of its own position, then the survivor
            assert list(a.sources.items()) == [
                (1, [(leaving.host_addr, leaving.transfer_port)]),
                (0, [(lh.host_addr, lh.transfer_port)])]
            assert leaving.stops and leaving.stops[0].lost_addrs == []
            assert leaving.goodbyes == []  # it serves its state until the group runs again
            await c.train(["localhost", "s1"], 5)
            [done] = await c.until(lambda: c.events("move.done"), "move.done")
            assert (done["lost"], done["taken"], done["restore_step"]) == (["a1"], {"a1": "s1"}, 4)
            assert done["lost_steps"] == 0 and done["recovery_s"] > 0
            await c.until(lambda: leaving.goodbyes, "the leaving rank's goodbye")
            assert leaving.goodbyes[0].reason == "moved to s1"
            await c.until(lambda: "hpct:" in c.reason["a1"], "our drain reason")
            assert c.reason["a1"] == "new DIMM; hpct: job 4242 moved its ranks to s1"
            await c.until(lambda: c.comments, "the job's comment")
            assert c.comments[-1].startswith("hpct: 0 fault(s), 1 move(s), replaced a1>s1")
            assert c.events("fault.detected") == [] and c.events("recovery.done") == []
            assert await c.finish() == 0
            assert "a1" not in c.ctl.world.spares
    run(scenario)


def test_a_drained_member_without_a_ready_spare_trains_on(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1"], spares=0) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            c.state["a1"] = "ALLOCATED+DRAIN"
            [skip] = await c.until(lambda: c.events("move.skipped"), "move.skipped")
            assert skip["node"] == "a1" and "no warm spare" in skip["why"]
            assert c.rank("a1").stops == []
            await c.train(["localhost", "a1"], 3)
            assert await c.finish() == 0
    run(scenario)


def test_a_corrupt_member_without_a_ready_spare_is_drained_at_once_and_trains_on(tmp_path):
    """A rank's replicas disagreed with it (recovery/crosscheck.py) and no spare is left: its
    node is drained in Slurm at once, said in an event and in `status`'s notes, and the drain
    carries the move from then on (the request is done with)."""
    from hpct_slurm.move_requests import CORRUPTION, ask_move
    from hpct_slurm.report.model import _notes

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1"], spares=0) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            path = ask_move(c.options.run_dir, "a1", f"{CORRUPTION}: rank 1's shared state at "
                                                     f"step 2 differed from its replicas'")
            [said] = await c.until(lambda: c.events("node.corrupt"), "node.corrupt")
            assert said["node"] == "a1" and "no warm spare" in said["action"]
            assert "DRAIN" in c.state["a1"] and c.reason["a1"].startswith(f"hpct: {CORRUPTION}")
            assert not path.exists()
            assert any("silent data corruption on a1" in n for n in _notes([said]))
            assert c.rank("a1").stops == []
            await c.train(["localhost", "a1"], 3)
            assert await c.finish() == 0
    run(scenario)


def test_a_corruption_request_no_poll_read_drains_its_node_at_the_runs_end(tmp_path):
    """The job's last comparison finds the flip moments before every rank is done: the
    request is there when the job ends, before the next poll, and drains the node then."""
    from hpct_slurm.move_requests import CORRUPTION, ask_move

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1"], spares=0, node_poll_s=60) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            path = ask_move(c.options.run_dir, "a1", f"{CORRUPTION}: rank 1's shared state at "
                                                     f"step 2 differed from its replicas'")
            assert await c.finish() == 0
            [said] = c.events("node.corrupt")
            assert said["node"] == "a1" and said["action"] == "drained at the run's end"
            assert "DRAIN" in c.state["a1"] and not path.exists()
    run(scenario)


def test_after_a_shrink_a_returning_node_grows_the_job_back(tmp_path, monkeypatch):
    # no wait for a spare on its way: the round shrinks at once, a2 returns and grows it back
    # (with the wait, a2 takes its own place back without a shrink: test_controller_fast)
    monkeypatch.setenv("HPCT_SPARE_WAIT_S", "0")

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2"], spares=0,
                               on_no_spare="shrink") as c:
            await c.started()
            await c.train(["localhost", "a1", "a2"], 3)
            # a2's next ranks register only once the shrink is decided: a spare already back
            # when the round decides would take its place instead (policy.decide_recovery)
            c.register_gate = asyncio.Event()
            await c.crash("a2", dead=False)  # its process: the node comes back as a spare
            await c.assigned("localhost", 1)
            assert c.ctl.world.members == ["localhost", "a1"]
            c.register_gate.set()
            await c.train(["localhost", "a1"], 4)
            await c.until(lambda: c.events("recovery.done"), "the shrink's recovery.done")

            back = await c.until(lambda: c.events("grow.assign"), "grow.assign", timeout=6)
            assert back[0]["members"] == ["localhost", "a1", "a2"]
            assert back[0]["shards"] == {"localhost": [0], "a1": [1], "a2": [2]}
            lh = await c.assigned("localhost", 2)
            assert (lh.world_size, lh.data_ranks, lh.restore_step) == (3, [0], 4)
            assert lh.data_world == 3
            a2 = [s for s in c.steps if s.node == "a2"][-1].ranks[0]
            await c.until(lambda: any(x.generation == 2 for x in a2.assigns), "a2's assign")
            assert [x.data_ranks for x in a2.assigns] == [[2]]
            await c.train(["localhost", "a1", "a2"], 5)
            [done] = await c.until(lambda: c.events("grow.done"), "grow.done")
            assert done["lost_steps"] == 0 and done["restore_step"] == 4
            await c.until(lambda: any("1 grow(s)" in x for x in c.comments), "the comment")
            assert await c.finish() == 0
    run(scenario)


def test_a_users_move_request_moves_the_node_and_bad_ones_are_answered(tmp_path):
    from hpct_slurm.move_requests import ask_move

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            run_dir = c.options.run_dir
            with pytest.raises(HpctError, match="not one node name"):
                ask_move(run_dir, "a1;rm -rf", "x")
            with pytest.raises(HpctError, match="printable line"):
                ask_move(run_dir, "a1", "two\nlines")
            with pytest.raises(HpctError, match="not a job's run dir"):
                ask_move(tmp_path, "a1", "x")
            await c.started()
            await c.train(["localhost", "a1"], 3)
            ask_move(run_dir, "nope", "typo")
            path = ask_move(run_dir, "a1", "swap the NIC")
            assert oct(path.stat().st_mode & 0o777) == "0o600"
            a = await c.assigned("s1", 1)
            assert (a.rank, a.restore_step) == (1, 3)
            [req] = c.events("move.requested")
            assert req["node"] == "a1" and req["reason"] == "user request: swap the NIC"
            [skip] = c.events("move.skipped")
            assert skip["node"] == "nope" and "not an active member" in skip["why"]
            assert not path.exists() and list((run_dir / "requests").iterdir()) == []
            await c.train(["localhost", "s1"], 4)
            await c.until(lambda: c.events("move.done"), "move.done")
            assert "a1" not in c.reason  # not drained by anyone: no reason written
            assert await c.finish() == 0
    run(scenario)


@pytest.mark.parametrize("asked_by", ["drain", "user"])
def test_a_move_cut_short_at_its_stop_by_another_fault_is_asked_again(tmp_path, asked_by):
    """a1 is to move (an admin's drain, a user's `move`), and a2 dies on the move's STOP: the
    round becomes a2's recovery. a1 stayed a member, so its move is asked again once a spare
    is ready, said in an event: before, it trained on to the end with a spare ready."""
    from hpct_slurm.move_requests import ask_move

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1", "s2"], spares=2) as c:
            await c.started()
            await c.train(["localhost", "a1", "a2"], 3)
            c.rank("a2").on_stop = "die"
            if asked_by == "drain":
                c.state["a1"], c.reason["a1"] = "ALLOCATED+DRAIN", "new DIMM"
            else:
                ask_move(c.options.run_dir, "a1", "swap the NIC")
            [cut] = await c.until(lambda: c.events("move.cut_short"), "move.cut_short")
            assert cut["node"] == "a1" and "asked again" in cut["why"]
            await c.assigned("localhost", 1)  # a2's recovery
            taker = next(iter(c.events("recovery.assign")[0]["taken"].values()))
            await c.train(["localhost", "a1", taker], 4)
            await c.until(lambda: c.events("recovery.done"), "a2's recovery.done")

            other = ({"s1", "s2"} - {taker}).pop()
            a = await c.assigned(other, 2)
            assert a.restore_step == 4
            first, again = c.events("move.requested")
            assert first["node"] == again["node"] == "a1" and again["again"] is True
            assert again["reason"] == first["reason"]
            await c.train(["localhost", other, taker], 5)
            [done] = await c.until(lambda: c.events("move.done"), "move.done")
            assert done["taken"] == {"a1": other} and done["lost_steps"] == 0
            assert await c.finish() == 0
    run(scenario)


@pytest.mark.parametrize("policy", ["leave", "reboot"])
def test_a_node_fenced_down_is_left_or_rebooted_per_the_admins_policy(tmp_path, monkeypatch,
                                                                      policy):
    monkeypatch.setenv("HPCT_ON_FENCED", policy)

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            await c.crash("a1")
            await c.assigned("s1", 1)
            await c.train(["localhost", "s1"], 3)
            [done] = await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert done["lost_steps"] == 0
            reboots = [a for a in c.runner.argvs if a[:2] == ["scontrol", "reboot"]]
            if policy == "reboot":
                await c.until(lambda: c.events("node.reboot"), "node.reboot")
                [argv] = [a for a in c.runner.argvs if a[:2] == ["scontrol", "reboot"]]
                assert argv[-1] == "a1" and argv[4].startswith("reason=hpct: reboot after fence")
            else:
                assert reboots == [] and c.events("node.reboot") == []
            # the record in Slurm after a fault
            await c.until(lambda: c.comments, "the job's comment")
            assert c.comments[-1].startswith("hpct: 1 fault(s), 0 move(s), replaced a1>s1")
            assert await c.finish() == 0
    run(scenario)


def test_a_bad_fence_policy_is_named_in_a_slurm_error_event(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCT_ON_FENCED", "explode")

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 1)
            await c.crash("a1")
            [err] = await c.until(lambda: [e for e in c.events("slurm.error")
                                           if "HPCT_ON_FENCED" in e["error"]], "the error")
            assert "explode" in err["error"]
            await c.assigned("s1", 1)
    run(scenario)


def test_spares_loop_says_where_each_node_is_and_what_comes_next():
    from hpct_slurm.spares.pool import loop_stage
    cases = {
        ("DOWN", "hpct: srun: node failure (job 3)", False): "fenced: down",
        ("DOWN+REBOOT_REQUESTED", "hpct: reboot after fence", False): "rebooting",
        ("IDLE+DRAIN", "fan; hpct: job 3 moved its ranks to n5", False): "moved off: drained",
        ("ALLOCATED+DRAIN", "fan; hpct: job 3 moved its ranks to n5", False):
            "moved off: drained (jobs still running)",
        ("IDLE+DRAIN", "hpct: health: shm below 64 MB", False): "health check failed: drained",
        ("IDLE", None, True): "pool spare",
        ("ALLOCATED", None, False): "in service",
    }
    for (state, reason, pool), want in cases.items():
        stage, nxt = loop_stage(node("n3", state, reason), pool)
        assert stage == want, (state, reason)
        assert nxt
    assert "spares return" in loop_stage(node("n3", "IDLE+DRAIN", "x"), False)[1]


def test_members_in_a_maintenance_reservation_before_the_job_ends_move():
    from hpct_slurm.controller.lifecycle import in_maintenance
    from hpct_slurm.slurm.client import parse_reservations
    text = ("ReservationName=fw StartTime=2026-11-23T18:00:00 EndTime=2026-11-23T20:00:00 "
            "Duration=02:00:00 Nodes=n[2-3] NodeCnt=2 Flags=MAINT,SPEC_NODES Users=root "
            "State=INACTIVE\n"
            "ReservationName=hpct_spares StartTime=2026-11-23T10:00:00 EndTime=2027-11-23T10:00:00"
            " Nodes=n5 NodeCnt=1 Flags=SPEC_NODES Users=root State=ACTIVE\n")
    resv = parse_reservations(text)
    assert [r.name for r in resv] == ["fw", "hpct_spares"] and resv[0].nodes == ["n2", "n3"]
    assert parse_reservations("No reservations in the system\n") == []
    now = "2026-11-23T17:00:00"
    members = ["n1", "n2", "n5"]
    assert in_maintenance(resv, members, "2026-11-23T19:00:00", now) == [
        ("n2", "maintenance reservation fw from 2026-11-23T18:00:00")]
    assert in_maintenance(resv, members, "2026-11-23T17:30:00", now) == []  # job ends first
    assert in_maintenance(resv, members, "Unknown", now) != []
    assert in_maintenance(resv, members, None, "2026-11-23T21:00:00") == []  # it is over
    with pytest.raises(HpctError, match="lacks"):
        parse_reservations("Nodes=n1 Flags=MAINT\n")


def test_a_member_in_an_upcoming_maintenance_reservation_moves(tmp_path, monkeypatch):
    from hpct_slurm.controller import lifecycle
    monkeypatch.setattr(lifecycle, "RESERVATION_POLL_S", 0.2)

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            c.reservations = ["ReservationName=fw StartTime=2000-01-01T00:00:00 "
                              "EndTime=2099-01-01T00:00:00 Nodes=a1 Flags=MAINT Users=root"]
            await c.started()
            await c.train(["localhost", "a1"], 2)
            a = await c.assigned("s1", 1)
            assert (a.rank, a.restore_step) == (1, 2)
            [req] = c.events("move.requested")
            assert req["node"] == "a1" and req["reason"].startswith("maintenance reservation fw")
            await c.train(["localhost", "s1"], 3)
            [done] = await c.until(lambda: c.events("move.done"), "move.done")
            assert done["lost_steps"] == 0
            assert await c.finish() == 0
    run(scenario)


def test_a_fault_that_rolls_back_counts_its_lost_steps(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 4)
            lh = c.rank("localhost")
            lh.own = [2, 3]  # its snapshot lags: the group must go back to step 3

            async def holds_3(rank, stop):
                await rank.holdings(own=[2, 3])
                rank.state = "ready"
                await rank.heartbeat()
            lh.on_stop = holds_3
            await c.crash("a1")
            a = await c.assigned("s1", 1)
            assert a.restore_step == 3
            await c.train(["localhost", "s1"], 4)
            [done] = await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert done["lost_steps"] == 1
            await c.until(lambda: c.comments, "the comment")
            assert "lost steps 1" in c.comments[-1]
            assert await c.finish() == 0
    run(scenario)


def test_a_comment_slurm_refuses_for_now_is_written_later(tmp_path):
    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            c.comment_refusals = 2  # slurmctld: "the DB index is being set, try again"
            await c.started()
            await c.train(["localhost", "a1"], 2)
            await c.crash("a1")
            await c.assigned("s1", 1)
            await c.train(["localhost", "s1"], 3)
            await c.until(lambda: c.comments, "the comment, on the third try", timeout=8)
            assert c.comments == ["hpct: 1 fault(s), 0 move(s), replaced a1>s1, pause "
                                  + c.comments[0].split("pause ")[1]]
            errors = [e for e in c.events("slurm.error") if "try again" in e["error"]]
            assert len(errors) == 2
            assert await c.finish() == 0
    run(scenario)
