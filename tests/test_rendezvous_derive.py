"""Rank layout, ports and env derived from SLURM_* (pure: no cluster needed)."""
from __future__ import annotations

import itertools
import json
import os
import re

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from hpct_slurm.errors import HpctError
from hpct_slurm.rendezvous.derive import (GENERATION_WINDOW, derive, derived_port,
                                          ifname_for_address, interface_addresses, job_window,
                                          layout, reserved_port, resolve_host)
from hpct_slurm.slurm.env import SlurmEnv

NODES = ["n1", "n2", "n3", "n4", "s1", "s2"]
ADDRS = {n: f"10.0.0.{i + 1}" for i, n in enumerate(NODES)}


def step_env(node: str, localid: int = 0, job_id: int = 4242, **extra: str) -> SlurmEnv:
    """The env of a task in a controller-launched `srun -N1 -w node` step."""
    environ = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "n[1-4],s[1-2]",
               "SLURMD_NODENAME": node, "SLURM_STEP_NODELIST": node, "SLURM_STEP_ID": "3",
               "SLURM_PROCID": str(localid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": "0",
               "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "4"}
    environ.update(extra)
    return SlurmEnv.from_environ(environ)


def fake_derive(env: SlurmEnv, generation: int, members=None, **kw):
    kw.setdefault("resolve", ADDRS.__getitem__)
    kw.setdefault("find_ifname", lambda addr: "eth0")
    return derive(env, generation, members, **kw)


# ---------------------------------------------------------------- ports

SPANS = st.sampled_from([64, 1000, 8192, 20000])
PER_HOST = st.sampled_from([1, 2, 8])


@given(job=st.integers(0, 10**9), gen=st.integers(0, 10**6), slot=st.integers(0, 7),
       base=st.integers(1024, 40000), span=SPANS, per_host=PER_HOST)
def test_derived_port_stays_in_range(job, gen, slot, base, span, per_host):
    slot %= per_host
    port = derived_port(job, gen, slot, port_base=base, port_span=span, nodes_per_host=per_host)
    assert base <= port < base + span


@given(job=st.integers(0, 10**9), djob=st.integers(0, 10**4), gen=st.integers(0, 10**6),
       dgen=st.integers(0, GENERATION_WINDOW - 1), slot_a=st.integers(0, 7),
       slot_b=st.integers(0, 7), span=SPANS, per_host=PER_HOST, base=st.integers(1024, 40000))
def test_derived_ports_never_collide_within_the_windows(job, djob, gen, dgen, slot_a, slot_b,
                                                       span, per_host, base):
    """Two (job, generation, host slot) on one host, jobs closer than job_window() and
    generations closer than GENERATION_WINDOW, never share a port."""
    djob %= job_window(span, per_host)
    slot_a %= per_host
    slot_b %= per_host
    assume((djob, dgen, slot_a) != (0, 0, slot_b))
    kw = dict(port_base=base, port_span=span, nodes_per_host=per_host)
    assert (derived_port(job, gen, slot_a, **kw)
            != derived_port(job + djob, gen + dgen, slot_b, **kw))


def test_derived_ports_of_a_whole_window_are_all_distinct():
    span, per_host = 512, 4
    window = job_window(span, per_host)
    ports = [derived_port(job, gen, node, port_span=span, nodes_per_host=per_host)
             for job, gen, node in itertools.product(range(777, 777 + window),
                                                     range(5, 5 + GENERATION_WINDOW),
                                                     range(per_host))]
    assert len(ports) == span == len(set(ports))


@given(lo=st.integers(1, 60000), count=st.integers(1, 64), gen=st.integers(0, 1000),
       per_host=st.integers(1, 64))
def test_reserved_ports_stay_in_the_reservation(lo, count, gen, per_host):
    hi = min(lo + count - 1, 65535)
    ports = [reserved_port((lo, hi), gen, slot, per_host) for slot in range(per_host)]
    assert all(lo <= p <= hi for p in ports)
    if hi - lo + 1 >= per_host:
        assert len(set(ports)) == per_host


@pytest.mark.parametrize("kw, message", [
    (dict(port_base=80), "port_base 80"),
    (dict(port_base=65000, port_span=1000), "runs past 65535"),
    (dict(port_span=4), "port_span 4 is too small"),
    (dict(nodes_per_host=0), "nodes_per_host 0"),
])
def test_bad_port_configuration_is_rejected(kw, message):
    with pytest.raises(HpctError, match=message):
        derived_port(1, 0, 0, **kw)


@pytest.mark.parametrize("args, message", [
    ((-1, 0, 0), "job_id -1"), ((1, -2, 0), "generation -2"), ((1, 0, 1), "host_slot 1")])
def test_negative_identifiers_are_rejected(args, message):
    with pytest.raises(HpctError, match=message):
        derived_port(*args)


# ---------------------------------------------------------------- layout


@given(per_node=st.lists(st.integers(1, 8), min_size=1, max_size=12))
def test_layout_is_a_bijection_onto_ranks(per_node):
    members = [f"n{i}" for i in range(len(per_node))]
    seen = set()
    for node_rank, node in enumerate(members):
        for local in range(per_node[node_rank]):
            rank, world, got_node_rank = layout(members, per_node, node, local)
            assert world == sum(per_node) and got_node_rank == node_rank
            seen.add(rank)
    assert seen == set(range(sum(per_node)))


# ---------------------------------------------------------------- derive


def test_controller_membership_gives_the_global_layout():
    members = ["n1", "n2", "s1", "n4"]  # s1 replaced n3 in generation 1
    info = fake_derive(step_env("s1", localid=2), 1, members, tasks_per_node=4)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size,
            info.node_rank) == (10, 16, 2, 4, 2)
    assert info.master_addr == "10.0.0.1" and info.addresses[2] == ADDRS["s1"]
    assert info.master_port == info.store_ports[0]
    # One node per host: one port per (job, generation), the same on every node.
    assert set(info.store_ports) == {derived_port(4242, 1, 0)}
    env = info.env()
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "NODE_RANK", "MASTER_ADDR", "HPCT_GENERATION")} == {
        "RANK": "10", "WORLD_SIZE": "16", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
        "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1", "HPCT_GENERATION": "1"}
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["TORCH_GLOO_LAZY_INIT"] == "0" and env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert env["MASTER_PORT"] == str(info.master_port)


def test_tasks_per_node_defaults_to_the_steps_own():
    info = fake_derive(step_env("n2", localid=3), 0, ["n1", "n2"])
    assert (info.rank, info.world_size) == (7, 8)


def test_generations_and_jobs_on_one_node_get_different_ports():
    members = ["n1", "n2"]
    a = fake_derive(step_env("n1"), 0, members)
    b = fake_derive(step_env("n1"), 1, members)
    c = fake_derive(step_env("n1", job_id=4243), 0, members)
    assert len({a.store_port, b.store_port, c.store_port}) == 3


def test_plain_srun_spanning_nodes_uses_slurms_ranks_and_reserved_ports():
    env = SlurmEnv.from_environ({
        "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-4],s[1-2]", "SLURMD_NODENAME": "n3",
        "SLURM_STEP_NODELIST": "n[1-4]", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2", "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "4(x4)",
        "SLURM_STEP_RESV_PORTS": "12000-12009"})
    info = fake_derive(env, 0)
    assert info.members == ("n1", "n2", "n3", "n4")
    assert (info.rank, info.world_size, info.node_rank, info.local_world_size) == (9, 16, 2, 4)
    assert set(info.store_ports) == {12000}  # one node per host: the reservation's first port
    assert set(fake_derive(env, 1).store_ports) == {12001}


def test_nodes_sharing_an_address_get_distinct_ports():
    one_host = {n: "127.0.0.1" for n in NODES}
    members = ["n1", "n2", "s1"]
    info = fake_derive(step_env("n1"), 0, members, resolve=one_host.__getitem__)
    assert len(set(info.store_ports)) == 3
    with pytest.raises(HpctError, match="3 member nodes share address 127.0.0.1 but "
                                        "nodes_per_host is 2"):
        fake_derive(step_env("n1"), 0, members, resolve=one_host.__getitem__, nodes_per_host=2)


def test_ports_ignore_a_shrunk_job_nodelist():
    """Steps launched after a node failure see a shorter SLURM_JOB_NODELIST than the
    survivors do; both must still agree on every port and rank."""
    members = ["n1", "n2", "s1", "n4"]
    survivor = fake_derive(step_env("n1"), 1, members)
    spare = fake_derive(step_env("s1", SLURM_JOB_NODELIST="n[1-2],n4,s[1-2]"), 1, members)
    assert survivor.store_ports == spare.store_ports
    assert (survivor.master_addr, survivor.master_port) == (spare.master_addr, spare.master_port)
    assert spare.rank == 8


@pytest.mark.parametrize("node, localid, members, message", [
    ("n3", 0, ["n1", "n2"], "node 'n3' is not a member"),
    ("n1", 0, ["n1", "n1"], r"members lists node\(s\) \['n1'\] more than once"),
    ("n1", 3, ["n1"], "SLURM_LOCALID 3 is outside the 2 tasks"),
    ("n1", 0, ["n1", "x9"], r"member node\(s\) \['x9'\] are not in SLURM_JOB_NODELIST"),
    ("n1", 0, [], "members is empty"),
])
def test_bad_membership_is_rejected(node, localid, members, message):
    with pytest.raises(HpctError, match=message):
        fake_derive(step_env(node, localid=localid), 0, members, tasks_per_node=2,
                    resolve=lambda n: "10.9.9.9")


def test_missing_step_variables_are_rejected():
    env = SlurmEnv.from_environ({"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1",
                                 "SLURMD_NODENAME": "n1"})
    with pytest.raises(HpctError, match="SLURM_LOCALID is not set"):
        fake_derive(env, 0, ["n1"])
    with pytest.raises(HpctError, match="generation -1"):
        fake_derive(step_env("n1"), -1, ["n1"])


def test_address_held_by_no_interface_is_rejected():
    with pytest.raises(HpctError, match="which no local interface holds: set HPCT_SOCKET_IFNAME"):
        fake_derive(step_env("n1"), 0, ["n1"], find_ifname=lambda a: None)


def test_real_resolution_and_interface_lookup():
    assert resolve_host("localhost").startswith("127.")
    assert ifname_for_address("127.0.0.1") == "lo"
    for name, addr in interface_addresses().items():
        if not addr.startswith("127."):
            assert ifname_for_address(addr) == name
    assert ifname_for_address("192.0.2.123") is None  # TEST-NET-1: assigned to no one
    with pytest.raises(HpctError, match="node name 'no-such-node.invalid' does not resolve"):
        resolve_host("no-such-node.invalid")


# ---------------------------------------------------------------- CLI and env knobs

LOCAL_TASK = {"SLURM_JOB_ID": "31", "SLURM_JOB_NODELIST": "localhost",
              "SLURMD_NODENAME": "localhost", "SLURM_STEP_NODELIST": "localhost",
              "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
              "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"}


def _cli(monkeypatch, capsys, environ: dict[str, str], *argv: str) -> tuple[int, str, str]:
    from hpct_slurm.cli import main

    for name in list(os.environ):
        if name.startswith(("SLURM", "HPCT_")):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    rc = main(["rendezvous", "env", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_prints_export_lines_for_the_task_prolog(monkeypatch, capsys):
    rc, out, _ = _cli(monkeypatch, capsys, LOCAL_TASK, "--generation", "3")
    assert rc == 0
    lines = out.splitlines()
    assert all(re.fullmatch(r"export [A-Z_]+=\S+", line) for line in lines), lines
    exported = dict(line[len("export "):].split("=", 1) for line in lines)
    assert exported["HPCT_GENERATION"] == "3" and exported["GLOO_SOCKET_IFNAME"] == "lo"
    assert exported["MASTER_PORT"] == str(derived_port(31, 3, 0))


def test_cli_json_follows_the_controllers_membership(monkeypatch, capsys):
    environ = dict(LOCAL_TASK, SLURM_JOB_NODELIST="other,localhost", HPCT_MEMBERS="other,localhost",
                   HPCT_TASKS_PER_NODE="1", HPCT_SOCKET_IFNAME="eth7",
                   SLURM_STEP_NODELIST="localhost")
    # "other" must resolve too: point it at loopback.
    monkeypatch.setattr("hpct_slurm.rendezvous.derive.resolve_host",
                        lambda name: "127.0.0.1" if name in ("other", "localhost") else name)
    rc, out, _ = _cli(monkeypatch, capsys, environ, "--format", "json")
    assert rc == 0
    data = json.loads(out)
    assert data["info"]["members"] == ["other", "localhost"]
    assert (data["env"]["RANK"], data["env"]["WORLD_SIZE"]) == ("1", "2")
    assert data["env"]["NCCL_SOCKET_IFNAME"] == "eth7"


def test_cli_outside_a_step_is_a_clear_error(monkeypatch, capsys):
    environ = {k: v for k, v in LOCAL_TASK.items() if k != "SLURM_LOCALID"}
    environ.pop("SLURM_PROCID")
    rc, _, err = _cli(monkeypatch, capsys, environ)
    assert rc == 2 and "SLURM_LOCALID is not set" in err


def test_bad_knob_is_a_clear_error(monkeypatch, capsys):
    rc, _, err = _cli(monkeypatch, capsys, dict(LOCAL_TASK, HPCT_PORT_BASE="2o000"))
    assert rc == 2 and "HPCT_PORT_BASE '2o000' is not a non-negative integer" in err


@pytest.mark.parametrize("name,value,message", [
    ("HPCT_PORT_BASE", "0", "HPCT_PORT_BASE=0 is out of range: it must be in 1024-65535"),
    ("HPCT_PORT_BASE", "-1", "HPCT_PORT_BASE=-1 is out of range: it must be in 1024-65535"),
    ("HPCT_PORT_BASE", "70000", "HPCT_PORT_BASE=70000 is out of range"),
    ("HPCT_PORT_SPAN", "0", "HPCT_PORT_SPAN=0 is out of range: it must be in 8-64512"),
    ("HPCT_PORT_SPAN", "-8192", "HPCT_PORT_SPAN=-8192 is out of range"),
    ("HPCT_NODES_PER_HOST", "0", "HPCT_NODES_PER_HOST=0 is out of range: it must be at least 1"),
    ("HPCT_TASKS_PER_NODE", "0", "HPCT_TASKS_PER_NODE=0 is out of range: it must be at least 1"),
    ("HPCT_GENERATION", "-2", "HPCT_GENERATION=-2 is out of range: it must be at least 0"),
    ("HPCT_PORT_BASE", "65000", "HPCT_PORT_BASE=65000 with HPCT_PORT_SPAN=8192: port_span 8192 "
                                "from port_base 65000 runs past 65535"),
])
def test_explicit_out_of_range_knob_is_an_error_not_the_default(name, value, message):
    """HPCT_PORT_BASE=0 used to mean the default (`or DEFAULT`): a set value is taken as
    meant, and one that cannot be used names its variable."""
    from hpct_slurm.rendezvous import derive_from_environ

    with pytest.raises(HpctError, match=re.escape(message)):
        derive_from_environ(environ=dict(LOCAL_TASK, **{name: value}),
                            resolve=lambda name: "127.0.0.1")


def test_knobs_set_in_range_are_used_and_generation_zero_is_kept():
    from hpct_slurm.rendezvous import derive_from_environ

    environ = dict(LOCAL_TASK, HPCT_PORT_BASE="30000", HPCT_PORT_SPAN="64", HPCT_GENERATION="0")
    info = derive_from_environ(environ=environ, resolve=lambda name: "127.0.0.1")
    assert info.generation == 0
    assert 30000 <= info.master_port < 30064
    assert info.master_port == derived_port(31, 0, 0, port_base=30000, port_span=64)
