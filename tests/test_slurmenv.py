"""SlurmEnv.from_environ: what a batch script and a step task see, good and bad values."""
from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, strategies as st

from hpct_slurm.errors import HpctError
from hpct_slurm.slurm.env import SlurmEnv, format_tasks_per_node, parse_tasks_per_node

# Captured from Slurm 22.05.8 (`sbatch -N2`, then `srun -N1 -n1 -w n1` inside it), trimmed.
BATCH = {
    "SLURMD_NODENAME": "n1", "SLURM_CPUS_ON_NODE": "1", "SLURM_JOB_ID": "1",
    "SLURM_JOB_NAME": "job.sh", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
    "SLURM_SUBMIT_DIR": "/tmp/sdev", "SLURM_TASKS_PER_NODE": "1(x2)",
}
STEP = {
    **BATCH, "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n1",
    "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1",
}


def test_batch_script_env() -> None:
    env = SlurmEnv.from_environ(BATCH)
    assert env.job_id == 1 and env.job_name == "job.sh"
    assert env.job_nodelist == ["n1", "n2"] and env.job_num_nodes == 2
    assert env.node_name == "n1" and env.batch_host == "n1"
    assert env.tasks_per_node == [1, 1]
    assert env.step_id is None and env.step_nodelist is None and not env.in_step
    assert env.restart_count == 0 and env.step_resv_ports is None
    assert env.submit_dir == "/tmp/sdev" and env.cpus_on_node == 1


@pytest.mark.parametrize("value, step", [("-5", 0xfffffffb), ("-4", 0xfffffffc),
                                         ("-6", 0xfffffffa), ("4294967291", 0xfffffffb)])
def test_special_step_ids_as_slurm_26_05_writes_them(value: str, step: int) -> None:
    # Slurm 26.05's batch script sees SLURM_STEP_ID=-5 (SLURM_BATCH_SCRIPT as a signed int)
    assert SlurmEnv.from_environ({**BATCH, "SLURM_STEP_ID": value}).step_id == step
    with pytest.raises(HpctError, match="SLURM_STEP_ID '-7' is not a non-negative integer"):
        SlurmEnv.from_environ({**BATCH, "SLURM_STEP_ID": "-7"})


def test_step_task_env() -> None:
    env = SlurmEnv.from_environ({**STEP, "SLURM_RESTART_COUNT": "2",
                                 "SLURM_STEP_RESV_PORTS": "12000-12004"})
    assert env.in_step and env.step_id == 0 and env.step_nodelist == ["n1"]
    assert env.procid == 0 and env.ntasks == 1 and env.tasks_per_node == [1]
    assert env.restart_count == 2 and env.step_resv_ports == (12000, 12004)


def test_multi_node_step() -> None:
    env = SlurmEnv.from_environ({
        "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "rack[1-2]-n[01-02]",
        "SLURMD_NODENAME": "rack2-n01", "SLURM_STEP_ID": "3",
        "SLURM_STEP_NODELIST": "rack1-n02,rack2-n01", "SLURM_STEP_TASKS_PER_NODE": "2,1",
        "SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_NODEID": "1",
        "SLURM_STEP_RESV_PORTS": "12001"})
    assert env.job_nodelist == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    assert env.tasks_per_node == [2, 1] and env.step_resv_ports == (12001, 12001)
    assert env.batch_host == "rack1-n01"


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(STEP) + ["SLURM_RESTART_COUNT"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n7")
    assert SlurmEnv.from_environ().job_id == 42


@pytest.mark.parametrize("changes, message", [
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set: not inside a Slurm job"),
    ({"SLURM_JOB_ID": "x1"}, "SLURM_JOB_ID 'x1' is not a Slurm job id"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID '-1' is not a non-negative integer"),
    ({"SLURM_LOCALID": ""}, "SLURM_LOCALID '' is not a non-negative integer"),
    ({"SLURM_NODEID": "٣"}, "SLURM_NODEID '٣' is not a non-negative integer"),
    ({"SLURM_RESTART_COUNT": "1.5"}, "SLURM_RESTART_COUNT '1.5' is not a non-negative"),
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST 'n[1-' is not a hostlist"),
    ({"SLURM_STEP_NODELIST": "n[2-1]"}, "SLURM_STEP_NODELIST 'n[2-1]' is not a hostlist"),
    ({"SLURM_JOB_NUM_NODES": "3"}, "SLURM_JOB_NUM_NODES '3' does not match the 2 nodes"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x)"}, "SLURM_STEP_TASKS_PER_NODE '1(x)' is not a"),
    ({"SLURM_STEP_TASKS_PER_NODE": "0"}, "SLURM_STEP_TASKS_PER_NODE '0' is not a"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x2)"},
     "SLURM_STEP_TASKS_PER_NODE '1(x2)' gives 2 nodes but the step has 1"),
    ({"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": "1,1"},
     "SLURM_TASKS_PER_NODE '1,1' gives 2 nodes but the step has 1"),
    ({"SLURM_PROCID": "1"}, "SLURM_PROCID '1' is not below SLURM_NTASKS '1'"),
    ({"SLURMD_NODENAME": "n9"}, "SLURMD_NODENAME 'n9' is not in SLURM_JOB_NODELIST 'n[1-2]'"),
    ({"SLURMD_NODENAME": "n2"}, "SLURMD_NODENAME 'n2' is not in SLURM_STEP_NODELIST 'n1'"),
    ({"SLURM_NODEID": "1"}, "SLURM_NODEID '1' is not below the 1 nodes"),
    ({"SLURM_STEP_RESV_PORTS": "12004-12000"}, "SLURM_STEP_RESV_PORTS '12004-12000' is not"),
    ({"SLURM_STEP_RESV_PORTS": "70000"}, "SLURM_STEP_RESV_PORTS '70000' is not a port"),
    ({"SLURM_STEP_RESV_PORTS": "12000,12002"}, "SLURM_STEP_RESV_PORTS '12000,12002' is not"),
])
def test_bad_values_name_the_variable(changes: dict, message: str) -> None:
    environ = dict(STEP)
    for key, value in changes.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    with pytest.raises(HpctError) as err:
        SlurmEnv.from_environ(environ)
    assert str(err.value).startswith(f"HPCT: {message}")


def test_batch_tasks_per_node_counts_job_nodes() -> None:
    with pytest.raises(HpctError, match="SLURM_TASKS_PER_NODE '1' gives 1 nodes but the step "
                                        "has 2"):
        SlurmEnv.from_environ({**BATCH, "SLURM_TASKS_PER_NODE": "1"})


@pytest.mark.parametrize("text, counts", [
    ("1", [1]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]), ("1,2,1", [1, 2, 1]),
])
def test_parse_tasks_per_node(text: str, counts: list[int]) -> None:
    assert parse_tasks_per_node(text) == counts
    assert format_tasks_per_node(counts) == text


@pytest.mark.parametrize("bad", ["", "2(x0)", "x", "2(3)", "1,,1", "1(x2", "-1"])
def test_parse_tasks_per_node_rejects(bad: str) -> None:
    with pytest.raises(HpctError) as err:
        parse_tasks_per_node(bad)
    assert f"SLURM_TASKS_PER_NODE {bad!r} is not a tasks-per-node list" in str(err.value)


@given(st.lists(st.integers(1, 64), min_size=1, max_size=40))
def test_tasks_per_node_round_trip(counts: list[int]) -> None:
    text = format_tasks_per_node(counts)
    assert parse_tasks_per_node(text) == counts
    # Slurm's form never repeats a value in two neighbouring items
    items = [item.split("(")[0] for item in text.split(",")]
    assert all(a != b for a, b in zip(items, items[1:]))


@pytest.mark.cluster
def test_real_step_environment_parses_and_agrees(cluster) -> None:
    """What srun really exports, parsed in every task of a 2-node, 3-task step."""
    proc = cluster.run(["srun", "-N2", "-n3", sys.executable, "-m", "hpct_slurm.cli", "env",
                        "--json"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    tasks = sorted((json.loads(line) for line in proc.stdout.splitlines()),
                   key=lambda t: t["procid"])
    assert [t["procid"] for t in tasks] == [0, 1, 2]
    first = tasks[0]
    assert len(first["step_nodelist"]) == 2 and sum(first["tasks_per_node"]) == 3
    for t in tasks:
        assert t["ntasks"] == 3 and t["job_id"] == first["job_id"]
        assert t["step_nodelist"] == first["step_nodelist"] == t["job_nodelist"]
        # SLURM_NODEID indexes the step's node list at this task's own node
        assert t["step_nodelist"][t["nodeid"]] == t["node_name"]
        assert t["node_name"] in cluster.nodes and t["batch_host"] == t["job_nodelist"][0]


@pytest.mark.parametrize("argv, changes, first_words", [
    (["env", "--json"], {"SLURM_PROCID": "-1"}, "HPCT: SLURM_PROCID '-1'"),
    (["env", "--json"], {"SLURM_STEP_TASKS_PER_NODE": "2(x0)"},
     "HPCT: SLURM_STEP_TASKS_PER_NODE '2(x0)'"),
    (["hostlist", "expand", "n[3-1]"], {}, "HPCT: hostlist 'n[3-1]' is not a hostlist"),
    (["hostlist", "expand", "n[01-"], {}, "HPCT: hostlist 'n[01-' is not a hostlist"),
])
def test_the_cli_says_what_is_wrong_in_one_line(argv, changes, first_words) -> None:
    """What a user sees at the command line: exit 2, one stderr line naming the bad value."""
    import subprocess

    env = {"PATH": "/usr/bin:/bin", **STEP, **changes}
    out = subprocess.run([sys.executable, "-m", "hpct_slurm.cli", *argv], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(first_words)
