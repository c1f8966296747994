"""The local cluster itself: real daemons, per-node identity, faults, clean teardown."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpct_slurm.errors import HpctError
from hpct_slurm.localcluster import LocalCluster
from hpct_slurm.localcluster.layout import Layout, slurm_conf

pytestmark = pytest.mark.cluster


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpct_slurm.cli", *argv],
                          capture_output=True, text=True, timeout=120)


def test_nodes_have_their_own_hostname_address_and_shm(cluster):
    seen = {}
    for node in cluster.nodes[:3]:
        out = cluster.run(["sh", "-c", "hostname; getent hosts n1; stat -f -c %i /dev/shm"],
                          node=node, check=True).stdout.split("\n")
        seen[node] = out
        assert out[0] == node
        assert out[1].split()[0] == cluster.node_addr("n1")
    # one tmpfs per node, like real nodes: their /dev/shm are different filesystems
    assert len({v[2] for v in seen.values()}) == 3


def test_kill_node_is_seen_by_slurm_and_revive_brings_it_back(cluster):
    victim = cluster.nodes[-1]
    pids = cluster.kill_node(victim)
    assert pids, "kill-node found no process of the node"
    assert cluster.node_pids(victim) == []
    states = cluster.wait_nodes({"idle*", "down*", "unknown*"}, nodes=[victim], timeout=60)
    assert states[victim].endswith("*")  # not responding
    assert cluster.revive_node(victim) is True  # a slurmd booted
    assert cluster.wait_nodes(nodes=[victim], timeout=60)[victim] == "idle"
    # A node Slurm holds DOWN (as the controller leaves a fenced one) while its slurmd runs:
    # revive-node --resume brings it back instead of refusing (issue 31)
    cluster.client().update_node(victim, "DOWN", reason="test: fenced")
    assert cluster.wait_nodes({"down"}, nodes=[victim], timeout=60)[victim] == "down"
    with pytest.raises(HpctError, match="or --resume it in Slurm"):
        cluster.revive_node(victim)
    assert cluster.revive_node(victim, resume=True) is False  # only resumed
    assert cluster.wait_nodes(nodes=[victim], timeout=60)[victim] == "idle"


def test_cut_link_partitions_a_node(cluster):
    a, b = cluster.nodes[0], cluster.nodes[1]
    # a TCP connect to b's slurmd: ping is not installed everywhere
    ping = [sys.executable, "-c", "import socket,sys; socket.create_connection("
            "(sys.argv[1], 6818), timeout=1).close()", cluster.node_addr(b)]
    assert cluster.run(ping, node=a).returncode == 0
    cluster.cut_link(b)
    try:
        assert cluster.run(ping, node=a).returncode != 0
    finally:
        cluster.cut_link(b, up=True)


def _pids_in_netns(name: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _comm(pid: int) -> str:
    """The process's name, or "" once it is gone (a zombie waiting for its reaper counts as
    gone: it holds no resources, and its parent may be an init that never reaps)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rpartition(")")[2].split()[0] == "Z":
            return ""
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, IndexError):
        return ""


def test_cli_up_status_exec_down_leaves_nothing(tmp_path):
    root = tmp_path / "lc"
    up = _cli("localcluster", "up", "--nodes", "4", "--root", str(root), "--json")
    assert up.returncode == 0, up.stderr
    status = json.loads(_cli("localcluster", "status", "--root", str(root), "--json").stdout)
    assert [n["state"] for n in status["nodes"]] == ["idle"] * 4
    sinfo = _cli("localcluster", "exec", "--root", str(root), "--", "sinfo", "-h", "-o", "%D %T")
    assert sinfo.stdout.split() == ["4", "idle"]
    # idempotent: a second up on a running cluster changes nothing
    again = json.loads(_cli("localcluster", "up", "--nodes", "4", "--root", str(root),
                            "--json").stdout)
    assert again["daemons"] == status["daemons"]
    # a running job step, so that down has slurmstepd and tasks to clean up too
    job = _cli("localcluster", "exec", "--root", str(root), "--", "sbatch", "--parsable", "-N2",
               "-o", "/dev/null", "--wrap", "srun -N2 sleep 300")
    assert job.returncode == 0, job.stderr
    lay = LocalCluster(root).layout
    deadline = time.monotonic() + 30
    while True:
        ours = [p for n in ["n1", "n2", "n3", "n4", None] for p in _pids_in_netns(lay.netns(n))]
        comms = {_comm(p) for p in ours}
        if {"slurmd", "slurmctld", "slurmstepd", "sleep"} <= comms:
            break
        assert time.monotonic() < deadline, f"the job's step never started: {sorted(comms)}"
        time.sleep(0.2)
    assert _cli("localcluster", "down", "--root", str(root)).returncode == 0
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lay.tag not in netns
    assert [p for p in ours if _comm(p)] == []
    assert _live_processes_mentioning(str(root)) == []


def test_ports_mode_runs_a_multi_node_job(tmp_path):
    """Loopback-ports mode: every node shares this host's name and address, told apart by port
    and SLURMD_NODENAME."""
    root = tmp_path / "ports"
    cluster = LocalCluster(root, nodes=2, mode="ports")
    try:
        status = cluster.up()
        assert [n["state"] for n in status["nodes"]] == ["idle", "idle"]
        out = cluster.run(["srun", "-N2", "-l", "printenv", "SLURMD_NODENAME"], timeout=60)
        assert out.returncode == 0, out.stderr
        assert sorted(line.split(": ")[1] for line in out.stdout.split("\n") if line) == \
            ["n1", "n2"]
    finally:
        cluster.down()
    assert _live_processes_mentioning(str(root)) == []


def test_up_on_a_dirty_root_recovers(tmp_path):
    root = tmp_path / "dirty"
    cluster = LocalCluster(root, nodes=2)
    cluster.up()
    st = cluster.state()
    # simulate a crashed `up`/reboot: the controller died, state.json stayed behind
    subprocess.run(["kill", "-9", str(st.slurmctld_pid)], check=True)
    time.sleep(0.2)
    try:
        status = LocalCluster(root).up()
        assert status["up"] and [n["state"] for n in status["nodes"]] == ["idle", "idle"]
    finally:
        LocalCluster(root).down()
    assert _live_processes_mentioning(str(root)) == []


def test_bad_arguments_are_refused_clearly(tmp_path):
    with pytest.raises(HpctError, match="--nodes 0"):
        LocalCluster(tmp_path / "x", nodes=0)
    with pytest.raises(HpctError, match="mode 'bogus'"):
        LocalCluster(tmp_path / "x", mode="bogus")
    out = _cli("localcluster", "kill-node", "n1", "--root", str(tmp_path / "none"))
    assert out.returncode == 2 and out.stderr.startswith("HPCT: no local cluster is up")


def test_ports_mode_conf_gives_distinct_ports(tmp_path):
    lay = Layout(tmp_path, 3, "ports", "host")
    conf = slurm_conf(lay)
    ports = [int(w.split("=")[1]) for w in conf.split() if w.startswith("Port=")]
    assert len(set(ports)) == 3 and lay.ctld_port not in ports


def _live_processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmd and stat.split(") ", 1)[1][0] != "Z":
            found.append(int(proc.name))
    return found
