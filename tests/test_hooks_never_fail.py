"""Issue 43: no exception from a parser, a missing command or a Slurm daemon that does not
answer makes a Prolog, Epilog or TaskProlog fail (a failed Prolog drains the node). The case
seen on Slurm 24.11: a stale /dev/shm/hpct/<job> dir left by a crashed job made the next job's
Prolog ask Slurm which jobs run; the parser raised TypeError, the Prolog failed, slurmctld
drained the node ("Prolog error"). Here the hook logs why and the job runs."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpct_slurm.events import read_events
from hpct_slurm.events import EventLog
from hpct_slurm.hooks.cli import never_fails
from hpct_slurm.hooks.context import HookConfig, JobContext
from hpct_slurm.hooks.node import SlurmNode
from hpct_slurm.hooks.prolog import prolog
from hpct_slurm.slurm import client as client_mod
from hpct_slurm.slurm.client import SlurmClient

NOBODY = 65534
DATA = Path(__file__).parent / "data" / "slurm"
RELEASES = sorted(p.name for p in DATA.iterdir() if p.is_dir())
STALE = 5  # a job no recording lists: its dir is what a crashed job left


@pytest.fixture
def cfg(tmp_path: Path) -> HookConfig:
    (tmp_path / "shm").mkdir()
    return HookConfig(shm_root=tmp_path / "shm" / "hpct", min_free_shm_mb=1)


def _job(job_id: int) -> JobContext:
    return JobContext(job_id=job_id, uid=NOBODY, gid=NOBODY, node="n1", requested_cache_mb=8)


def _log(tmp_path: Path) -> EventLog:
    return EventLog(path=tmp_path / "events.jsonl", source="prolog")


def _node(answer) -> SlurmNode:
    """The real SlurmNode, its client's commands answered by `answer(argv)`: stdout text, or an
    exception to raise."""
    def runner(argv, **kwargs):
        out = answer(list(argv))
        if isinstance(out, BaseException):
            raise out
        return subprocess.CompletedProcess(argv, 0, stdout=out, stderr="")
    node = SlurmNode()
    node.client = SlurmClient(runner=runner)
    return node


def _stale_dir(cfg: HookConfig, tmp_path: Path) -> Path:
    """A dir a crashed job left behind (its Prolog ran, its Epilog never did)."""
    class Everything:
        def active_job_ids(self):
            return {STALE}

        def drain(self, node, reason):
            raise AssertionError("no drain expected")
    prolog(_job(STALE), cfg, Everything(), _log(tmp_path))
    path = cfg.shm_root / str(STALE)
    assert path.is_dir()
    return path


def _events(tmp_path: Path) -> list[dict]:
    return list(read_events(tmp_path / "events.jsonl"))


@pytest.mark.parametrize("release", RELEASES)
def test_stale_dir_is_swept_on_each_release_recorded_output(release, cfg, tmp_path) -> None:
    stale = _stale_dir(cfg, tmp_path)
    squeue = (DATA / release / "squeue.json").read_text()
    ids = dict(kv.split("=") for kv in (DATA / release / "jobs.txt").read_text().split())
    running = int(ids["running"])
    (cfg.shm_root / str(running)).mkdir()  # a live job's dir on this node: kept
    res = prolog(_job(42), cfg, _node(lambda argv: squeue), _log(tmp_path))
    assert res.healthy and res.job_dir == cfg.shm_root / "42"
    assert res.stale_removed == [STALE] and not stale.exists()
    assert (cfg.shm_root / str(running)).is_dir()


@pytest.mark.parametrize("failure, said", [
    # a parser bug at the pure-function boundary (what drained n2 on 24.11)
    ("parser", "TypeError: int() argument must be"),
    # what Slurm itself can do to a read
    ("missing", "squeue is not installed or not on PATH"),
    ("no answer", "no answer within"),
    ("garbage", "squeue --json output is not JSON"),
    ("unknown layout", "squeue --json: field 'jobs' missing"),
])
def test_a_failed_slurm_read_never_fails_the_prolog(failure, said, cfg, tmp_path,
                                                    monkeypatch) -> None:
    stale = _stale_dir(cfg, tmp_path)
    recorded = (DATA / "24.11" / "squeue.json").read_text()
    answer = {
        "parser": lambda argv: recorded,
        "missing": lambda argv: FileNotFoundError(argv[0]),
        "no answer": lambda argv: subprocess.TimeoutExpired(argv, 10),
        "garbage": lambda argv: "squeue: error: slurm_load_jobs: socket timed out",
        "unknown layout": lambda argv: '{"meta": {}, "errors": [], "warnings": []}',
    }[failure]
    if failure == "parser":
        def broken(text):
            int([])  # the TypeError the 22.05-only parser raised on 24.11's job_state list
        monkeypatch.setattr(client_mod, "parse_squeue_json", broken)
    res = prolog(_job(42), cfg, _node(answer), _log(tmp_path))
    assert res.healthy and res.job_dir == cfg.shm_root / "42"
    assert res.stale_removed == [] and stale.is_dir()  # unknown is not "none": nothing swept
    [skipped] = [e for e in _events(tmp_path) if e["event"] == "hook_stale_skipped"]
    assert said in skipped["reason"] and skipped["present"] == [STALE]


def test_never_fails_logs_and_exits_0(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HPCT_HOOKS_LOG", str(tmp_path / "hooks.jsonl"))
    monkeypatch.setenv("SLURM_JOB_ID", "42")

    def bug() -> int:
        raise KeyError("job_state")
    assert never_fails("prolog", bug) == 0
    assert "prolog could not do its work, the job runs without it: KeyError" in \
        capsys.readouterr().err
    [event] = read_events(tmp_path / "hooks.jsonl")
    assert event["event"] == "hook_failed" and event["job_id"] == "42"
    assert never_fails("prolog", lambda: 1) == 1  # the health verdict is the hook's to give


def _hook_env(tmp_path: Path, path: str, **extra: str) -> dict:
    return {"PATH": path, "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n1",
            "SLURM_JOB_UID": str(NOBODY), "SLURM_JOB_GID": str(NOBODY),
            "HPCT_SHM_ROOT": str(tmp_path / "shm" / "hpct"),
            "HPCT_HOOKS_LOG": str(tmp_path / "hooks.jsonl"), "HPCT_HEALTH_MIN_SHM_MB": "1",
            **extra}


def _fake_squeue(tmp_path: Path, body: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "squeue"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return f"{bin_dir}:/usr/bin:/bin"


@pytest.mark.parametrize("squeue, swept", [
    ('cat "$RECORDED"', True),                      # Slurm 24.11's real answer
    ("echo 'squeue: error: Unable to contact slurm controller' >&2; exit 1", False),
    ("echo '{\"jobs\": [{\"job_id\": 7, \"job_state\": {\"x\": 1}}]}'", False),
])
def test_the_prolog_command_runs_the_job_whatever_squeue_says(squeue, swept, cfg,
                                                             tmp_path) -> None:
    stale = _stale_dir(cfg, tmp_path)
    env = _hook_env(tmp_path, _fake_squeue(tmp_path, squeue),
                    RECORDED=str(DATA / "24.11" / "squeue.json"))
    out = subprocess.run([sys.executable, "-m", "hpct_slurm.cli", "prolog"], env=env,
                         capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert (cfg.shm_root / "42").is_dir()
    assert stale.exists() is not swept


@pytest.mark.parametrize("command", ["prolog", "epilog", "task-prolog"])
def test_a_hook_that_cannot_start_its_work_exits_0(command, tmp_path) -> None:
    env = _hook_env(tmp_path, "/usr/bin:/bin", HPCT_SHM_ROOT="relative/root")
    out = subprocess.run([sys.executable, "-m", "hpct_slurm.cli", command], env=env,
                         capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert "could not do its work, the job runs without it" in out.stderr
    assert "HPCT_SHM_ROOT" in out.stderr
    assert os.path.exists(tmp_path / "hooks.jsonl") or command == "task-prolog"
