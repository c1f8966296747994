"""Spare pool on the real local cluster: every step visible in `scontrol show node`."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from hpct_slurm.localcluster import LocalCluster
from hpct_slurm.slurm.hostlist import expand
from hpct_slurm.spares import CHECK_RESERVATION, FEATURE, POOL_RESERVATION

pytestmark = pytest.mark.cluster


def spares(cluster: LocalCluster, *args: str):
    """`hpct-slurm spares ...` as an admin on the cluster would run it (SLURM_CONF, plain
    scontrol in the controller's namespace)."""
    return cluster.run([sys.executable, "-m", "hpct_slurm.cli", "spares", *args], timeout=120)


def spares_json(cluster: LocalCluster, *args: str) -> dict:
    proc = spares(cluster, *args, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def show_node(cluster: LocalCluster, name: str) -> dict[str, str]:
    """The fields of `scontrol show node` we assert on, read from its text."""
    text = cluster.run(["scontrol", "show", "node", name], check=True).stdout
    patterns = {"AvailableFeatures": r"\bAvailableFeatures=(\S*)", "State": r"\bState=(\S+)",
                "Reason": r"^\s*Reason=(.*)$", "Comment": r"^\s*Comment=(.*)$"}
    fields = {}
    for key, pattern in patterns.items():
        m = re.search(pattern, text, re.MULTILINE)
        fields[key] = m.group(1).strip() if m else ""
    return fields


def reservation_nodes(cluster: LocalCluster, name: str) -> list[str] | None:
    proc = cluster.run(["scontrol", "show", "reservation", "-o", name])
    if proc.returncode != 0:
        return None
    return expand(re.search(r"\bNodes=(\S*)", proc.stdout).group(1))


def clean_pool(cluster: LocalCluster) -> None:
    """Undo what the pool wrote into Slurm: reservations, labels, records."""
    for res in (POOL_RESERVATION, CHECK_RESERVATION):
        cluster.run(["scontrol", "delete", f"ReservationName={res}"])
    cluster.run(["scontrol", "update", f"NodeName={','.join(cluster.nodes)}",
                 "AvailableFeatures=", "ActiveFeatures=", "Comment="])


def cluster_exec(cluster: LocalCluster, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "hpct_slurm.cli", "localcluster", "exec", "--root",
         str(cluster.root), "--", sys.executable, "-m", "hpct_slurm.cli", *args],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_add_drain_check_remove_each_visible_in_scontrol(cluster):
    a, b = cluster.nodes[3], cluster.nodes[4]
    try:
        out = spares_json(cluster, "add", a, b)
        assert [(o["node"], o["action"]) for o in out["nodes"]] == [(a, "added"), (b, "added")]
        for n in (a, b):
            shown = show_node(cluster, n)
            assert FEATURE in shown["AvailableFeatures"].split(",")
            assert shown["Comment"].startswith("hpct: spare pool add by ")
        assert reservation_nodes(cluster, POOL_RESERVATION) == [a, b]
        # Pool nodes are fenced: an ordinary job asking for one does not start there.
        fenced = cluster.run(["srun", "-N1", "-w", a, "--immediate=2", "true"], timeout=30)
        assert fenced.returncode != 0
        again = spares_json(cluster, "add", a)
        assert again["nodes"] == [{"node": a, "action": "already in pool", "changed": False,
                                   "detail": ""}]

        # b fails the way the controller takes a node out.
        cluster.client().update_node(b, "DRAIN", reason=f"hpct: node failure on {b} (test)")
        shown = show_node(cluster, b)
        assert "DRAIN" in shown["State"] and shown["Reason"].startswith("hpct: node failure")
        listed = {m["name"]: m for m in spares_json(cluster, "list")["pool"]}
        assert listed[b]["state"] == "DRAINED" and listed[b]["reason"].startswith("hpct:")

        checked = spares_json(cluster, "check")
        assert [(o["node"], o["action"]) for o in checked["nodes"]] == [(b, "returned to pool")]
        shown = show_node(cluster, b)
        assert "DRAIN" not in shown["State"]
        assert shown["Comment"].startswith("hpct: returned to pool by ")
        assert "was hpct: node failure" in shown["Comment"]
        assert FEATURE in shown["AvailableFeatures"].split(",")

        removed = spares_json(cluster, "remove", a)
        assert [(o["node"], o["action"]) for o in removed["nodes"]] == [(a, "removed")]
        shown = show_node(cluster, a)
        assert FEATURE not in shown["AvailableFeatures"].split(",")
        assert shown["Comment"].startswith("hpct: spare pool remove by ")
        assert reservation_nodes(cluster, POOL_RESERVATION) == [b]

        # The same CLI through `localcluster exec`, as the docs tell an admin to run it.
        via_exec = cluster_exec(cluster, "spares", "list", "--json")
        assert [m["name"] for m in json.loads(via_exec)["pool"]] == [b]

        assert spares_json(cluster, "remove", b)["nodes"][0]["action"] == "removed"
        assert reservation_nodes(cluster, POOL_RESERVATION) is None  # empty pool: no resv
    finally:
        clean_pool(cluster)


def test_add_refuses_a_node_running_a_job(cluster):
    victim = cluster.nodes[0]
    client = cluster.client()
    job_id = client.sbatch(options=["-N1", "-w", victim, "--job-name=someone",
                                    "-o", "/dev/null"], wrap="sleep 300")
    try:
        deadline = time.monotonic() + 30
        while client.show_job(job_id).state != "RUNNING":
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.2)
        proc = spares(cluster, "add", victim, "--json")
        assert proc.returncode == 2
        assert "refusing" in proc.stderr and str(job_id) in proc.stderr
        assert reservation_nodes(cluster, POOL_RESERVATION) is None
        assert FEATURE not in show_node(cluster, victim)["AvailableFeatures"]
        assert client.show_job(job_id).state == "RUNNING"
    finally:
        client.cancel(job_id)
        clean_pool(cluster)


def test_check_keeps_a_dead_node_drained(cluster):
    victim = cluster.nodes[1]
    try:
        cluster.kill_node(victim)
        cluster.client().update_node(victim, "DRAIN",
                                     reason=f"hpct: node failure on {victim} (test)")
        checked = spares_json(cluster, "check")
        assert [(o["node"], o["action"]) for o in checked["nodes"]] == [(victim, "unhealthy")]
        shown = show_node(cluster, victim)
        assert "DRAIN" in shown["State"]
        assert shown["Reason"].startswith("hpct: health check failed by ")
        assert reservation_nodes(cluster, CHECK_RESERVATION) is None  # the fence is gone
    finally:
        clean_pool(cluster)
