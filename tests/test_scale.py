"""Issue 16, fast tier: the controller's pacing and per-rank Assign view (the store's fan-out
is in test_store_fanout.py), bench scale's phase extraction and a small end-to-end run of it (the
real controller process against simulated ranks), and the goodput model's measured terms."""
from __future__ import annotations

import json
import os

import pytest

from hpct_slurm import protocol as P
from hpct_slurm.controller.pacing import (MESSAGE_BUDGET_PER_S, MISSED_BEATS,
                                          SOURCES_PER_RANK, assign_view, compact_members,
                                          pace, should_report)
from hpct_slurm.recovery.ring import replica_peer_rank


# ---- pacing ---------------------------------------------------------------------------------
def test_small_worlds_keep_the_defaults():
    p = pace(64, 3.0)
    assert (p.heartbeat_s, p.step_report_s, p.silence_timeout_s) == (0.5, 0.0, 3.0)
    assert p.env() == {}  # a small job's ranks see exactly the environment they always did


@pytest.mark.parametrize("ranks", [1000, 2304, 16384])
def test_large_worlds_stay_within_the_message_budget(ranks):
    p = pace(ranks, 3.0)
    rate = ranks / p.heartbeat_s + ranks / p.step_report_s
    assert rate <= MESSAGE_BUDGET_PER_S * 1.01
    assert p.silence_timeout_s >= MISSED_BEATS * p.heartbeat_s
    assert p.env() == {"HPCT_HEARTBEAT_S": f"{p.heartbeat_s:g}",
                       "HPCT_STEP_REPORT_S": f"{p.step_report_s:g}"}


def test_pace_refuses_an_empty_world():
    with pytest.raises(ValueError, match="ranks 0"):
        pace(0, 3.0)


def test_step_reports_are_paced_but_a_generations_first_step_always_goes():
    assert should_report(5, 1, None, 100.0, 2.0)
    assert should_report(6, 2, (1, 100.0), 100.1, 2.0)       # a new generation
    assert not should_report(6, 1, (1, 100.0), 101.0, 2.0)   # within the interval
    assert should_report(7, 1, (1, 100.0), 102.0, 2.0)
    assert should_report(6, 1, (1, 100.0), 100.1, 0.0)       # unpaced: every step


# ---- the Assign a rank gets ----------------------------------------------------------------
def _table(world):
    peers = {r: (f"10.0.{r // 256}.{r % 256}", 40000 + r) for r in range(world)}
    return peers, {r: [peers[r]] for r in range(world)}


def test_small_worlds_get_the_full_view():
    peers, sources = _table(64)
    assert assign_view(5, 64, 8, sources, peers) == (sources, peers)
    assert compact_members(["a", "b"], 64) == (["a", "b"], "")


def test_large_worlds_get_the_peers_a_rank_uses_and_a_few_spread_sources():
    world, nodes = 2304, 288
    peers, sources = _table(world)
    firsts = set()
    for rank in (0, 7, 1000, 2303):
        src, prs = assign_view(rank, world, nodes, sources, peers)
        holder = replica_peer_rank(rank, nodes, world // nodes)
        assert set(prs) == {rank, holder} and prs[holder] == peers[holder]
        assert len(src) == SOURCES_PER_RANK and all(src[r] == sources[r] for r in src)
        firsts.add(next(iter(src)))  # its own position first
    assert len(firsts) == 4  # different ranks read from different survivors


def test_a_large_assign_fits_the_header_and_keeps_member_order():
    world, tpn = 16384, 8
    members = ["localhost"] + [f"sim{i:05d}" for i in range(1, world // tpn)]
    members[1000] = "sim02049"  # a spare took a lost node's place
    peers, sources = _table(world)
    names, hostlist = compact_members(members, world)
    src, prs = assign_view(1000 * tpn, world, len(members), sources, peers)
    msg = P.Assign(1, 1000 * tpn, world, names, tpn, 5, src, [1000 * tpn], world, prs, hostlist)
    secret, nonce = os.urandom(32), os.urandom(P.NONCE_BYTES)
    frame = P.Channel(secret, "1", nonce, "server").encode(msg)
    got = P.Channel(secret, "1", nonce, "client").decode(frame).msg
    assert got.member_nodes() == members
    assert len(frame) < 2048
    # what it replaces: the whole table in every Assign does not even fit one frame's header
    with pytest.raises(P.ProtocolError):
        P.Channel(secret, "1", nonce, "server").encode(
            P.Assign(1, 0, world, members, tpn, 5, sources, [0], world, peers))


def test_a_bad_member_hostlist_is_a_protocol_error_naming_the_field():
    msg = P.Assign(1, 0, 8, [], 8, -1, members_hostlist="n[1-")
    with pytest.raises(P.ProtocolError, match="members_hostlist"):
        msg.member_nodes()


# ---- bench scale ------------------------------------------------------------------------------
def test_round_phases_from_the_controllers_events():
    from hpct_slurm.bench.scale import round_phases

    ev = [{"t": 9.0, "event": "fault.detected", "reason": "old"},
          {"t": 10.5, "event": "fault.detected", "reason": "connection lost"},
          {"t": 10.7, "event": "fault.stop_sent"},
          {"t": 11.0, "event": "recovery.assign", "generation": 2},
          {"t": 13.0, "event": "recovery.done", "generation": 2}]
    r = round_phases(ev, 10.0, 2, 11.25, 64, 64)
    assert r["reason"] == "connection lost"
    assert r["fault_to_detect_s"] == pytest.approx(0.5)
    assert r["detect_to_stop_sent_s"] == pytest.approx(0.2)
    assert r["detect_to_assign_s"] == pytest.approx(0.5)
    assert r["assign_to_all_acked_s"] == pytest.approx(0.25)
    assert r["assign_to_first_step_s"] == pytest.approx(2.0)
    from hpct_slurm.errors import HpctError
    with pytest.raises(HpctError, match="recovery.assign"):
        round_phases(ev, 10.0, 3, None, 0, 64)


def test_bench_scale_refuses_a_world_not_made_of_nodes_of_8():
    from hpct_slurm.bench.scale import node_names
    from hpct_slurm.errors import HpctError

    with pytest.raises(HpctError, match="--ranks 20 must be a positive multiple of 8"):
        node_names(20, 1)


def test_bench_scale_end_to_end_small(tmp_path):
    """The real controller process, 64 simulated ranks, one dropped node."""
    from hpct_slurm.bench.scale import headline, measure

    m = measure(64, 0.2, tmp_path, ["drop"], window_s=1.0)
    (r,) = m["rounds"]
    assert r["reason"] == "connection lost" and r["acked"] == r["world"] == 64
    assert 0 < r["detect_to_assign_s"] < 10 and 0 < r["assign_to_all_acked_s"] < 10
    sent = m["steady"]["messages_per_s"]
    assert sent["heartbeat"] > 64  # every rank beats at 0.5 s
    # nodes of 8 are relayed: their heartbeats go up together, a few frames per node a second
    assert sent["frame"] * 4 < sent["heartbeat"] + sent.get("step_done", 0)
    h = headline(m)
    # (0 is a real reading: 8 relayed nodes cost the controller about a clock tick a second)
    assert h["ranks"] == 64 and 0 <= h["controller_cpu_pct"] < 100 and h["controller_rss_mb"] > 0


# ---- goodput ----------------------------------------------------------------------------------
def test_goodput_takes_the_scale_measurements_and_says_what_stays_assumed(tmp_path):
    from hpct_slurm.goodput.model import evaluate, load_params, recovery_budget

    def run(detect, stop, acked):
        return {"rounds": [{"fault": "silent", "fault_to_detect_s": detect,
                            "detect_to_assign_s": stop, "assign_to_all_acked_s": acked}]}
    path = tmp_path / "scale.json"
    path.write_text(json.dumps({"bench": "scale", "runs": {"2304": run(14.0, 0.4, 0.3),
                                                           "16384": run(98.0, 0.9, 0.8)}}))
    p = load_params([path])
    budget = {t["term"]: t for t in recovery_budget(2304, p)}
    assert budget["detect"]["s"] == pytest.approx(14.0, rel=0.05)
    assert budget["detect"]["source"] == f"measured: {path}"
    assert budget["first_step"]["source"].startswith("assumed")
    assert evaluate(16384, p).hpct_recovery_s > evaluate(2304, p).hpct_recovery_s
    plain = {t["term"]: t for t in recovery_budget(2304, load_params([]))}
    assert plain["detect"]["source"].startswith("assumed")
    assert plain["assign_to_acked"] == {"term": "assign_to_acked", "s": 0.0,
                                        "source": "assumed: inside first_step_s"}


def test_large_worlds_set_kernel_keepalives_small_ones_do_not():
    import socket

    from hpct_slurm.protocol.pacing import KEEPALIVE_COUNT, KEEPALIVE_IDLE_S, set_keepalive
    assert pace(2304, 3.0).keepalive and not pace(64, 3.0).keepalive
    with socket.socket() as s:
        set_keepalive(s)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_COUNT
    set_keepalive(None)  # a transport without a socket: nothing to set
