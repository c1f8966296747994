"""Spare pool: the pure decisions (records, labels, refusals, which nodes `check` takes)."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpct_slurm.errors import HpctError
from hpct_slurm.slurm.client import JobInfo, NodeInfo, parse_reservation_nodes
from hpct_slurm.spares.pool import (FEATURE, blocking_jobs, drained_by_hpct, passive_health,
                                    pool_nodes, record, refusal, with_feature)

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def node(name="n1", state="IDLE", flags=(), reason=None, features=()):
    return NodeInfo(name=name, state=state, flags=frozenset(flags), reason=reason, addr=None,
                    hostname=None, features=tuple(features), active_features=tuple(features))


def job(job_id, nodes, state="RUNNING", user="alice"):
    return JobInfo(job_id=job_id, name="j", user=user, state=state, nodelist=list(nodes),
                   batch_host=None, restart_count=0, reason=None, exit_code=0, exit_signal=0,
                   flags=None)


def test_record_is_one_hpct_line_with_who_and_when():
    assert record("spare pool add", "root", AT) == \
        "hpct: spare pool add by root at 2026-01-02T03:04:05Z"
    assert record("health check failed", "root", AT, "probe\nfailed") == \
        "hpct: health check failed by root at 2026-01-02T03:04:05Z: probe failed"


@given(st.lists(st.sampled_from(["gpu", "ib", "a100", FEATURE]), unique=True), st.booleans())
def test_label_keeps_other_features(features, present):
    out = with_feature(features, present)
    assert (FEATURE in out) == present
    assert [f for f in out if f != FEATURE] == [f for f in features if f != FEATURE]
    assert with_feature(out, present) == out  # idempotent


def test_only_unfinished_jobs_on_the_node_block():
    jobs = [job(1, ["n1", "n2"]), job(2, ["n1"], state="COMPLETED"), job(3, ["n3"]),
            job(4, [], state="PENDING")]
    assert [j.job_id for j in blocking_jobs("n1", jobs)] == [1]
    assert blocking_jobs("n4", jobs) == []
    msg = refusal("n1", blocking_jobs("n1", jobs))
    assert "'n1'" in msg and "1 (alice)" in msg and "refusing" in msg


@pytest.mark.parametrize("n, want", [
    (node(flags={"DRAIN"}, reason="hpct: node failure on n1"), True),
    (node(state="DOWN", flags={"NOT_RESPONDING"}, reason="hpct: heartbeat lost"), True),
    (node(flags={"DRAIN"}, reason="bad DIMM, ticket 42"), False),   # an admin's own drain
    (node(reason="hpct: stale reason on an idle node"), False),     # in service
    (node(flags={"DRAIN"}, reason=None), False),
])
def test_check_takes_only_nodes_hpct_drained(n, want):
    assert drained_by_hpct(n) is want


def test_passive_health_rules_out_nodes_slurm_cannot_hear():
    assert passive_health(node(flags={"DRAIN"})) is None
    assert "not responding" in passive_health(node(flags={"DRAIN", "NOT_RESPONDING"}))
    assert "not responding" in passive_health(node(state="DOWN"))


def test_pool_listing_reports_missing_labels():
    nodes = [node("n1", features=[FEATURE]), node("n2", flags={"DRAIN"}, reason="hpct: x")]
    listed = pool_nodes(nodes, ["n1", "n2", "gone"], {"n1": "hpct: spare pool add"})
    assert [(p.name, p.state, p.labelled) for p in listed] == \
        [("n1", "IDLE", True), ("n2", "DRAINED", False), ("gone", "UNKNOWN", False)]
    assert listed[0].comment == "hpct: spare pool add" and listed[1].reason == "hpct: x"


def test_reservation_nodes_parse():
    line = ("ReservationName=hpct_spares StartTime=2026-11-22T03:43:33 "
            "EndTime=2027-11-22T03:43:33 Duration=365-00:00:00 Nodes=n[1-2],n5 NodeCnt=3 "
            "CoreCnt=24 Features=(null) PartitionName=(null) Flags=SPEC_NODES TRES=cpu=24 "
            "Users=root Groups=(null) Accounts=(null)\n")
    assert parse_reservation_nodes(line) == ["n1", "n2", "n5"]
    with pytest.raises(HpctError, match="2 records"):
        parse_reservation_nodes(line + line)
