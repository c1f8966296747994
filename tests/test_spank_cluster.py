"""The SPANK plugin and the hooks under the real slurmctld/slurmd: options in sbatch and srun,
strict refusal of bad values, the env tasks see, the job's shm dir (owner, mode, removal, stale
sweep), health-check drains, and 4 ranks on one node sharing one cache copy."""
from __future__ import annotations

import grp
import json
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hpct_slurm.controller.controller import Options
from hpct_slurm.hooks.install import plugstack_line
from hpct_slurm.hooks.prolog import DRAIN_PREFIX
from hpct_slurm.localcluster.jobs import wait_finished
from hpct_slurm.localcluster.layout import Hooks

pytestmark = pytest.mark.cluster

HPCT = str(Path(sys.executable).parent / "hpct-slurm")
CONTROLLER_SETTINGS = {"collective_timeout_s": Options.collective_timeout_s,
                       "init_timeout_s": Options.init_timeout_s}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, _session_cluster):
    """The admin's steps of docs/admin.md, through the same commands: `hpct-slurm hooks
    install`, then `hpct-slurm spank build` (which prints the plugstack.conf line)."""
    d = tmp_path_factory.mktemp("hpct-spank")
    log = d / "hooks.jsonl"
    inst = subprocess.run([HPCT, "hooks", "install", str(d / "hooks"), "--python", sys.executable,
                           "--set", f"SLURM_CONF={_session_cluster.conf_path}",
                           "--set", f"HPCT_HOOKS_LOG={log}"],
                          capture_output=True, text=True, timeout=60)
    assert inst.returncode == 0, inst.stderr
    hooks = {name: d / "hooks" / f"{name}.sh" for name in ("prolog", "epilog", "task_prolog")}
    assert all(p.is_file() for p in hooks.values()), inst.stdout
    built = subprocess.run([HPCT, "spank", "build", "--out", str(d / "hpct_spank.so")],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip().startswith(f"required {d / 'hpct_spank.so'}")
    _session_cluster.heal()
    _session_cluster.set_hooks(Hooks(prolog=str(hooks["prolog"]), epilog=str(hooks["epilog"])))
    try:
        _wait_hooks_active(_session_cluster, log)
        yield {"plugin": d / "hpct_spank.so", "log": log}
    finally:
        _session_cluster.set_hooks(Hooks())


def _wait_hooks_active(cluster, log: Path) -> None:
    """`scontrol reconfigure` reaches each slurmd in its own time: a job started too early
    runs without the Prolog. Probe every node until its prolog has run."""
    nodes = len(cluster.nodes)
    for _ in range(30):
        p = _sbatch_wait(cluster, ["sbatch", "--parsable", f"-N{nodes}", "-o", "/dev/null",
                                   "--wrap", "true"], timeout=60)
        assert p.returncode == 0, p.stderr
        ran = {e["node"] for e in _hook_events(log, _job_id(p.stdout))
               if e["event"] == "hook_job_dir"}
        if len(ran) == nodes:
            return
        time.sleep(0.3)
    raise AssertionError("the Prolog never ran on every node after scontrol reconfigure")


@pytest.fixture
def hpct(cluster, artifacts):
    """Plugin (with hpct= task env) on top of the module's Prolog/Epilog; plugstack.conf is
    read at each srun/sbatch, so it takes effect at once. Restored to empty afterwards."""
    cluster.set_plugstack([plugstack_line(artifacts["plugin"], hpct=HPCT, max_cache_mb=512)])
    try:
        yield cluster
    finally:
        cluster.set_plugstack([])


def _env_lines(text: str) -> list[dict[str, str]]:
    """Blocks of `env` output separated by '---'."""
    blocks = []
    for block in text.split("---"):
        env = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if env:
            blocks.append(env)
    return blocks


def _job_id(text: str) -> int:
    return int(text.strip().split(";")[0])


def _sbatch_wait(cluster, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`sbatch --parsable ...` and its job waited for every 0.3 s, the CompletedProcess of the
    submission with the job's exit code as its returncode. `sbatch --wait` looks after 2, 8,
    then 32 s (Slurm 22.05): a job of 11 s in a busy CI run held its test for 42 s."""
    assert "--wait" not in argv and "--parsable" in argv
    p = cluster.run(argv, timeout=timeout)
    if p.returncode == 0:
        job = _job_id(p.stdout)
        wait_finished(cluster, job, timeout, f"job {job}")
        p.returncode = cluster.client().show_job(job).exit_code
    return p


def _hook_events(log: Path, job_id: int) -> list[dict]:
    if not log.exists():
        return []
    return [e for e in map(json.loads, log.read_text().splitlines())
            if e.get("job_id") == job_id]


def _wait(pred, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached in {timeout} s")


def test_srun_options_reach_every_task_with_the_derived_env(hpct, artifacts):
    p = hpct.run(["srun", "-l", "-N2", "-n2", "-w", "n1,n2", "--hpct-spares=1",
                  "--hpct-cache-mb=64", "--hpct-rendezvous=tcpstore", "sh", "-c",
                  "env; stat -c 'HPCT_TEST_DIR=%u:%a' $HPCT_SHM_DIR"], timeout=60)
    assert p.returncode == 0, p.stderr
    by_task: dict[str, dict[str, str]] = {}
    for line in p.stdout.splitlines():  # `-l`: every line is "<task>: <text>"
        task, _, text = line.partition(": ")
        if "=" in text:
            by_task.setdefault(task.strip(), {}).__setitem__(*text.split("=", 1))
    envs = list(by_task.values())
    assert sorted(e["SLURM_PROCID"] for e in envs) == ["0", "1"]
    # each node's prolog made the dir before the tasks ran
    assert [e["HPCT_TEST_DIR"] for e in envs] == ["0:700", "0:700"]
    job = int(envs[0]["SLURM_JOB_ID"])
    for env in envs:
        assert env["HPCT_SPARES"] == "1" and env["HPCT_STORE"] == "tcpstore"
        assert env["HPCT_SHM_DIR"] == f"/dev/shm/hpct/{job}" and env["HPCT_CACHE_MB"] == "64"
        # the rendezvous env, derived once in Python (`hpct-slurm task-prolog`)
        assert env["RANK"] == env["SLURM_PROCID"] and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == hpct.node_addr("n1") and env["HPCT_GENERATION"] == "0"
    made = {e["node"]: e["granted_mb"] for e in _hook_events(artifacts["log"], job)
            if e["event"] == "hook_job_dir"}
    assert made == {"n1": 64, "n2": 64}


def test_sbatch_options_reach_prolog_batch_script_and_steps(hpct, artifacts, tmp_path):
    out = tmp_path / "out.txt"
    p = _sbatch_wait(hpct, ["sbatch", "--parsable", "-N1", "-w", "n2", "--hpct-spares=2",
                  "--hpct-cache-mb=32", "-o", str(out), "--wrap",
                  "env; echo ---; srun -n1 env; echo ---"], timeout=60)
    assert p.returncode == 0, p.stderr
    job = _job_id(p.stdout)
    batch, step = _env_lines(out.read_text())
    for env in (batch, step):
        assert env["HPCT_SPARES"] == "2" and env["HPCT_CACHE_MB"] == "32"
        assert env["HPCT_SHM_DIR"] == f"/dev/shm/hpct/{job}"
    [made] = [e for e in _hook_events(artifacts["log"], job) if e["event"] == "hook_job_dir"]
    assert (made["node"], made["requested_mb"], made["granted_mb"]) == ("n2", 32, 32)


@pytest.mark.parametrize("argv, message", [
    (["srun", "--hpct-cache-mb=abc", "true"], "--hpct-cache-mb 'abc' is not an integer in 0..512"),
    (["srun", "--hpct-cache-mb=513", "true"], "--hpct-cache-mb '513' is not an integer in 0..512"),
    (["sbatch", "--hpct-spares=-1", "--wrap", "true"], "--hpct-spares '-1' is not an integer"),
    (["sbatch", "--hpct-rendezvous=etcd", "--wrap", "true"],
     "--hpct-rendezvous 'etcd' is not rootless or tcpstore"),
])
def test_bad_values_are_refused_before_a_job_exists(hpct, argv, message):
    p = hpct.run(argv, timeout=30)
    assert p.returncode != 0 and f"hpct: {message}" in p.stderr
    assert hpct.run(["squeue", "-h", "-t", "PD,R"]).stdout.strip() == ""


def test_unknown_plugstack_key_is_an_error(hpct, artifacts):
    hpct.set_plugstack([plugstack_line(artifacts["plugin"], max_cache_mb=64, cachemb=5)])
    p = hpct.run(["srun", "-N1", "true"], timeout=30)
    assert p.returncode != 0 and "unknown key 'cachemb'" in p.stderr


def test_job_dir_owner_mode_removal_and_stale_sweep(hpct, artifacts, tmp_path):
    # nobody cannot read this machine's python, so this job runs without the task env
    hpct.set_plugstack([plugstack_line(artifacts["plugin"])])
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").touch()
    # a crashed job's dir (with a link out of it) and a planted link, both without epilog
    plant = ('mkdir -p /dev/shm/hpct/999999/sub && ln -sfn "$1" /dev/shm/hpct/999999/sub/link '
             '&& ln -sfn "$1" /dev/shm/hpct/888888')
    assert hpct.run(["sh", "-c", plant, "plant", str(victim)], node="n3").returncode == 0
    # a batch job as nobody: srun and salloc have no --uid/--gid from Slurm 23.x on (24.11,
    # 26.05), sbatch has them on every release; its output goes where nobody may write.
    # Numeric ids: 26.05's sbatch refuses --uid=nobody ("Invalid --uid specification")
    nobody, nogroup = pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid
    out_dir = Path(tempfile.mkdtemp(prefix="hpct-spank-out-"))
    try:
        out_dir.chmod(0o777)
        out = out_dir / "out.txt"
        p = _sbatch_wait(hpct, [
            "sbatch", "--parsable", "-N1", "-w", "n3", f"--uid={nobody}", f"--gid={nogroup}",
            "--chdir=/tmp", "-o", str(out), "--wrap",
            "id -u; stat -c '%u %g %a' /dev/shm/hpct/$SLURM_JOB_ID; ls /dev/shm/hpct"],
            timeout=60)
        assert p.returncode == 0, p.stderr + (out.read_text() if out.exists() else "")
        stdout = out.read_text()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    uid, owner, listing = stdout.split("\n", 2)
    assert uid == str(nobody) and owner == f"{nobody} {nogroup} 700"
    assert "999999" not in listing and "888888" not in listing
    job = int(listing.split()[0])
    assert [p.name for p in victim.iterdir()] == ["keep"]
    # the epilog runs after the job ends
    _wait(lambda: hpct.run(["ls", "/dev/shm/hpct"], node="n3").stdout.split() == [],
          what="epilog removing the job dir")
    events = [e["event"] for e in _hook_events(artifacts["log"], job)]
    assert events == ["hook_job_dir", "hook_job_dir_removed"]


def test_failed_health_check_drains_the_node_with_a_reason(hpct):
    # an shm root others could write into is unsafe: the health check must catch it
    assert hpct.run(["chmod", "0777", "/dev/shm/hpct"], node="n4").returncode == 0
    p = hpct.run(["sbatch", "--parsable", "-N1", "-w", "n4", "-o", "/dev/null", "--wrap",
                  "true"], timeout=30)
    assert p.returncode == 0, p.stderr
    job = _job_id(p.stdout)
    try:
        def reason():
            out = hpct.run(["sinfo", "-h", "-n", "n4", "-o", "%T|%E"]).stdout.strip()
            return out if out.startswith("drain") else None
        state, why = _wait(reason, what=f"n4 drained by job {job}'s prolog").split("|", 1)
        assert why.startswith(DRAIN_PREFIX) and "/dev/shm/hpct" in why and "mode 0777" in why
        # the job never ran there: once the failed prolog is reported, Slurm requeues it held
        held = _wait(lambda: hpct.run(["squeue", "-h", "-j", str(job), "-o", "%T|%r"])
                     .stdout.strip().startswith("PENDING") and
                     hpct.run(["squeue", "-h", "-j", str(job), "-o", "%r"]).stdout.strip(),
                     what="job requeued")
        assert "held" in held
    finally:
        hpct.run(["chmod", "0755", "/dev/shm/hpct"], node="n4")
        hpct.run(["scancel", str(job)])
        hpct.run(["scontrol", "update", "NodeName=n4", "State=RESUME"])


RANK_SCRIPT = r"""
import json, os, pathlib, time
import numpy as np
from hpct_slurm.cache import SharedCache
cache = SharedCache.from_env()
entry = cache.get("train", lambda: {"x": np.ones((4096, 1024), np.float32)})  # 16 MiB
entry.arrays["x"].sum()
d = pathlib.Path(os.environ["HPCT_SHM_DIR"])
(d / f"ready.{os.environ['SLURM_PROCID']}").touch()
while len(list(d.glob("ready.*"))) < 4:
    time.sleep(0.01)
st = os.statvfs("/dev/shm")
shmem = [l for l in open("/proc/self/status") if l.startswith("RssShmem")][0].split()[1]
print(json.dumps({"rank": os.environ["SLURM_PROCID"], "built": entry.built,
                  "used": (st.f_blocks - st.f_bfree) * st.f_frsize, "shmem_kb": int(shmem),
                  "budget_mb": cache.budget_mb, "host": os.uname().nodename}), flush=True)
(d / f"done.{os.environ['SLURM_PROCID']}").touch()
while len(list(d.glob("done.*"))) < 4:
    time.sleep(0.01)
"""


def test_four_ranks_on_a_node_share_one_cache_copy(hpct):
    used_before = int(hpct.run([sys.executable, "-c", "import os; s=os.statvfs('/dev/shm'); "
                                "print((s.f_blocks - s.f_bfree) * s.f_frsize)"],
                               node="n5", check=True).stdout)
    p = hpct.run(["srun", "-N1", "-n4", "-w", "n5", "--hpct-cache-mb=64", sys.executable, "-c",
                  RANK_SCRIPT], timeout=120)
    assert p.returncode == 0, p.stderr
    ranks = [json.loads(line) for line in p.stdout.splitlines()]
    nbytes = 4096 * 1024 * 4
    assert sorted(r["rank"] for r in ranks) == ["0", "1", "2", "3"]
    assert {r["host"] for r in ranks} == {"n5"} and {r["budget_mb"] for r in ranks} == {64}
    assert sum(r["built"] for r in ranks) == 1
    # every rank measured while all four held the mapping: the node's shm grew by one copy
    for r in ranks:
        assert nbytes <= r["used"] - used_before < nbytes * 1.1
        assert r["shmem_kb"] * 1024 >= nbytes


def test_sbatch_hpct_options_drive_the_controller(hpct, tmp_path):
    """`sbatch --hpct-spares=1 --hpct-rendezvous=tcpstore`: the controller in the batch script
    keeps one spare node and the ranks rendezvous through a TCPStore, with no controller flag."""
    import shlex

    from hpct_slurm.localcluster.jobs import controller_events, rank_events

    run_dir = tmp_path / "run"
    train = [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", "3"]
    p = _sbatch_wait(hpct, ["sbatch", "--parsable", "-N2", "--hpct-spares=1",
                  "--hpct-rendezvous=tcpstore", "-o", str(tmp_path / "out.txt"),
                  "--wrap", shlex.join([HPCT, "controller", "--run-dir", str(run_dir), "--",
                                        *train])], timeout=180)
    assert p.returncode == 0, (p.stderr, (tmp_path / "out.txt").read_text())
    evs = controller_events(run_dir)
    [start] = [e for e in evs if e["event"] == "controller.start"]
    assert (start["active"], start["spares"], start["store"]) == (["n1"], ["n2"], "tcpstore")
    assert any(e["event"] == "job.done" for e in evs)
    ranks = rank_events(run_dir)
    assert [e["step"] for e in ranks if e["event"] == "rank.step"] == [0, 1, 2]
    assert not any(e["event"] == "store.shard_started" for e in ranks)
    # the plugin's task prolog derives a rendezvous env (120 s collective timeout for steps
    # nobody supervises); ranks the controller launched keep the controller's settings, the
    # same as without the plugin (tests/test_recovery_cluster.py checks those)
    settings = [e["settings"] for e in ranks if e["event"] == "rank.registered"]
    assert settings and all(s == {**CONTROLLER_SETTINGS, "store": "tcpstore"}
                            for s in settings), settings
