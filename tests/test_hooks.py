"""Prolog/epilog/task-prolog logic on a private shm root: owner and mode, budgets, stale sweep,
and every path-traversal and symlink attempt refused. The real slurmd runs them in
test_spank_cluster.py."""
from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpct_slurm.errors import HpctError
from hpct_slurm.events import EventLog, read_events
from hpct_slurm.hooks.context import HookConfig, JobContext
from hpct_slurm.hooks.epilog import epilog
from hpct_slurm.hooks.install import compiler_message, install_hooks, plugstack_line
from hpct_slurm.hooks.prolog import DRAIN_PREFIX, grant_mb, prolog
from hpct_slurm.hooks.shm import ShmRoot, check_job_id, check_name, read_budget
from hpct_slurm.hooks.task_prolog import format_exports, parse_exports, task_env

NOBODY = 65534


class RecordingSlurm:
    """Stands in for slurmctld: which jobs are active, and what was drained."""

    def __init__(self, active: set[int] | None = frozenset()):
        self.active = None if active is None else set(active)
        self.drained: list[tuple[str, str]] = []

    def active_job_ids(self) -> set[int] | None:
        return self.active

    def drain(self, node: str, reason: str) -> None:
        self.drained.append((node, reason))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "shm" / "hpct"


@pytest.fixture
def cfg(root: Path) -> HookConfig:
    root.parent.mkdir()
    return HookConfig(shm_root=root, min_free_shm_mb=1)


def _job(job_id: int = 42, cache_mb: int | None = 8) -> JobContext:
    return JobContext(job_id=job_id, uid=NOBODY, gid=NOBODY, node="n1",
                      requested_cache_mb=cache_mb)


def _log(tmp_path: Path) -> EventLog:
    return EventLog(path=tmp_path / "events.jsonl", source="test")


def _outside(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    (victim / "precious").write_text("keep me")
    return victim


def test_prolog_creates_job_dir_owned_by_user_mode_0700(cfg, root, tmp_path):
    res = prolog(_job(), cfg, RecordingSlurm(), _log(tmp_path))
    assert res.healthy and res.job_dir == root / "42"
    st_ = os.stat(root / "42", follow_symlinks=False)
    assert stat.S_ISDIR(st_.st_mode)
    assert (st_.st_uid, st_.st_gid, stat.S_IMODE(st_.st_mode)) == (NOBODY, NOBODY, 0o700)
    root_st = os.stat(root)
    assert (root_st.st_uid, stat.S_IMODE(root_st.st_mode)) == (os.geteuid(), 0o755)
    assert read_budget(root, 42) == 8 == res.granted_mb
    events = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert events == ["hook_job_dir"]


def test_epilog_removes_the_dir_without_following_links(cfg, root, tmp_path):
    victim = _outside(tmp_path)
    prolog(_job(), cfg, RecordingSlurm(), _log(tmp_path))
    (root / "42" / "data").mkdir()
    os.symlink(victim, root / "42" / "data" / "to-victim")
    os.symlink(victim / "precious", root / "42" / "file-link")
    assert epilog(_job(), cfg, _log(tmp_path)) is True
    assert not (root / "42").exists() and read_budget(root, 42) is None
    assert (victim / "precious").read_text() == "keep me"
    assert epilog(_job(), cfg, _log(tmp_path)) is False


def test_symlink_planted_as_the_job_dir_is_replaced_not_followed(cfg, root, tmp_path):
    victim = _outside(tmp_path)
    root.mkdir(mode=0o755)
    os.symlink(victim, root / "42")
    res = prolog(_job(), cfg, RecordingSlurm(), _log(tmp_path))
    assert res.healthy
    assert not os.path.islink(root / "42") and os.stat(root / "42").st_uid == NOBODY
    v = os.stat(victim)
    assert (v.st_uid, stat.S_IMODE(v.st_mode)) == (os.geteuid(), 0o755)  # never chowned
    assert (victim / "precious").read_text() == "keep me"
    [ev] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "hook_job_dir"]
    assert ev["replaced"] is True


def test_requeued_job_keeps_its_own_warm_dir(cfg, root, tmp_path):
    prolog(_job(), cfg, RecordingSlurm(), _log(tmp_path))
    (root / "42" / "warm.npy").write_bytes(b"x")
    prolog(_job(), cfg, RecordingSlurm(active={42}), _log(tmp_path))
    assert (root / "42" / "warm.npy").exists()


@pytest.mark.parametrize("make", ["symlink", "foreign-owner", "world-writable"])
def test_unsafe_shm_root_fails_health_and_drains(cfg, root, tmp_path, make):
    victim = _outside(tmp_path)
    if make == "symlink":
        os.symlink(victim, root)
    else:
        root.mkdir()
        if make == "foreign-owner":
            os.chown(root, NOBODY, NOBODY)
        os.chmod(root, 0o777 if make == "world-writable" else 0o755)
    slurm = RecordingSlurm()
    res = prolog(_job(), cfg, slurm, _log(tmp_path))
    assert not res.healthy and res.job_dir is None
    [(node, reason)] = slurm.drained
    assert node == "n1" and reason.startswith(DRAIN_PREFIX) and str(root) in reason
    assert sorted(os.listdir(victim)) == ["precious"]


def test_unreachable_slurmctld_still_fails_the_prolog(cfg, root, tmp_path):
    class Unreachable(RecordingSlurm):
        def drain(self, node: str, reason: str) -> None:
            raise HpctError("scontrol update failed: Unable to contact slurm controller")
    os.symlink(tmp_path, root)
    assert not prolog(_job(), cfg, Unreachable(), _log(tmp_path)).healthy
    events = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert events == ["hook_health_failed", "hook_drain_failed"]


def test_low_shm_drains_with_reason(root, tmp_path):
    root.parent.mkdir()
    cfg = HookConfig(shm_root=root, min_free_shm_mb=1 << 40)
    slurm = RecordingSlurm()
    assert not prolog(_job(), cfg, slurm, _log(tmp_path)).healthy
    assert "HPCT_HEALTH_MIN_SHM_MB" in slurm.drained[0][1]


def test_stale_dirs_of_finished_jobs_are_swept(cfg, root, tmp_path):
    victim = _outside(tmp_path)
    for job in (5, 6):
        prolog(_job(job), cfg, RecordingSlurm(active={5, 6}), _log(tmp_path))
    os.symlink(victim, root / "5" / "escape")
    os.symlink(victim, root / "7")          # a planted link with a job-id name
    (root / "notes").mkdir()                # not a job id: not ours to judge
    res = prolog(_job(42), cfg, RecordingSlurm(active={6, 42}), _log(tmp_path))
    assert res.stale_removed == [5, 7]
    assert sorted(os.listdir(root)) == [".lock", "42", "42.budget", "6", "6.budget", "notes"]
    assert sorted(os.listdir(victim)) == ["precious"]


def test_no_sweep_when_slurm_cannot_say_which_jobs_run(cfg, root, tmp_path):
    prolog(_job(5), cfg, RecordingSlurm(), _log(tmp_path))
    res = prolog(_job(42), cfg, RecordingSlurm(active=None), _log(tmp_path))
    assert res.stale_removed == [] and (root / "5").is_dir()


def test_budget_is_shared_between_jobs(cfg, root, tmp_path):
    root.parent.mkdir(exist_ok=True)
    with ShmRoot(root, create=True) as r:
        capacity = int(r.capacity_mb() * cfg.shm_fraction)
    first = prolog(_job(1, capacity - 10), cfg, RecordingSlurm({1, 2}), _log(tmp_path))
    second = prolog(_job(2, 100), cfg, RecordingSlurm({1, 2}), _log(tmp_path))
    assert (first.granted_mb, second.granted_mb) == (capacity - 10, 10)


def test_prolog_holds_the_root_lock_while_it_sweeps_and_grants(cfg, root, tmp_path):
    prolog(_job(5), cfg, RecordingSlurm(), _log(tmp_path))  # something to sweep
    seen = []

    class Probing(RecordingSlurm):
        def active_job_ids(self):
            # a second prolog (its own open file) must not get the lock now
            fd = os.open(root / ".lock", os.O_RDWR | os.O_NOFOLLOW)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("locked")
            finally:
                os.close(fd)
            return super().active_job_ids()
    assert prolog(_job(42), cfg, Probing({5, 42}), _log(tmp_path)).healthy
    assert seen == ["locked"]
    fd = os.open(root / ".lock", os.O_RDWR | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released afterwards
    finally:
        os.close(fd)
    assert stat.S_IMODE(os.stat(root / ".lock").st_mode) == 0o600


def test_concurrent_prologs_never_grant_more_than_the_budget(cfg, root, tmp_path):
    root.parent.mkdir(exist_ok=True)
    with ShmRoot(root, create=True) as r:
        capacity = int(r.capacity_mb() * cfg.shm_fraction)
    jobs = list(range(1, 9))
    want = capacity // 4 + 1  # only three fit in full
    ctx = mp.get_context("fork")
    with ctx.Pool(len(jobs)) as pool:
        grants = pool.starmap(_granted, [(j, want, cfg, jobs, str(tmp_path)) for j in jobs])
    assert sum(grants) <= capacity
    assert sorted(grants, reverse=True)[:3] == [want] * 3
    with ShmRoot(root) as r:
        assert r.budgets_mb() == dict(zip(jobs, grants))


def _granted(job: int, mb: int, cfg: HookConfig, jobs: list[int], log_dir: str) -> int:
    log = EventLog(path=Path(log_dir) / f"events-{job}.jsonl", source="test")
    return prolog(_job(job, mb), cfg, RecordingSlurm(set(jobs)), log).granted_mb


@pytest.mark.parametrize("plant", ["symlink", "directory"])
def test_a_planted_lock_file_is_refused_not_followed(cfg, root, tmp_path, plant):
    victim = _outside(tmp_path)
    os.chmod(victim / "precious", 0o644)
    root.mkdir(mode=0o755)
    if plant == "symlink":
        os.symlink(victim / "precious", root / ".lock")
    else:
        (root / ".lock").mkdir()
    with pytest.raises(HpctError, match="lock file .* remove it"):
        prolog(_job(), cfg, RecordingSlurm(), _log(tmp_path))
    assert (victim / "precious").read_text() == "keep me"
    assert stat.S_IMODE(os.stat(victim / "precious").st_mode) == 0o644
    assert not (root / "42").exists()


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
def test_grant_never_exceeds_request_or_what_is_left(req, cap, others):
    g = grant_mb(req, cap, others)
    assert 0 <= g <= req and (g <= cap - others or g == 0)
    assert g == req or g == max(0, cap - others)


@pytest.mark.parametrize("bad", ["../../etc", "0", "007", "-1", "1/2", "4294967296", "1 ",
                                 "", "١٢"])
def test_malicious_job_ids_are_refused(bad):
    with pytest.raises(HpctError, match="is not a Slurm job id"):
        check_job_id(bad)
    env = {"SLURM_JOB_ID": bad, "SLURMD_NODENAME": "n1", "SLURM_JOB_UID": "0",
           "SLURM_JOB_GID": "0"}
    with pytest.raises(HpctError):
        JobContext.from_env(env)


@pytest.mark.parametrize("bad", ["..", ".", "../x", "a/b", ".hidden", "", "x" * 65, "a\nb",
                                 "/abs"])
def test_malicious_cache_names_are_refused(bad):
    with pytest.raises(HpctError, match="is not a plain name"):
        check_name(bad)


def test_shm_root_setting_must_be_absolute():
    with pytest.raises(HpctError, match="HPCT_SHM_ROOT"):
        HookConfig.from_env({"HPCT_SHM_ROOT": "/dev/shm/../etc"})
    with pytest.raises(HpctError, match="HPCT_SHM_FRACTION"):
        HookConfig.from_env({"HPCT_SHM_FRACTION": "2"})


def test_task_env_exports_dir_and_grant(cfg, root, tmp_path):
    prolog(_job(42, 16), cfg, RecordingSlurm(), _log(tmp_path))
    env = task_env({"SLURM_JOB_ID": "42", "HPCT_SHM_ROOT": str(root), "HPCT_CACHE_MB": "99"})
    assert env == {"HPCT_SHM_DIR": str(root / "42"), "HPCT_CACHE_MB": "16"}
    assert parse_exports(format_exports(env)) == env
    assert task_env({}) == {}
    with pytest.raises(HpctError):
        format_exports({"X": "a\nexport LD_PRELOAD=/evil"})


def test_task_prolog_cli_prints_export_lines(cfg, root, tmp_path):
    prolog(_job(42, 16), cfg, RecordingSlurm(), _log(tmp_path))
    env = {**os.environ, "SLURM_JOB_ID": "42", "HPCT_SHM_ROOT": str(root)}
    out = subprocess.run([sys.executable, "-m", "hpct_slurm.cli", "task-prolog"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"export HPCT_SHM_DIR={root / '42'}" in lines and "export HPCT_CACHE_MB=16" in lines


def test_installed_hook_scripts_run_the_cli(tmp_path):
    scripts = install_hooks(tmp_path / "hooks", sys.executable,
                            {"HPCT_SHM_ROOT": str(tmp_path / "it's root")})
    assert set(scripts) == {"prolog", "epilog", "task_prolog"}
    text = scripts["prolog"].read_text()
    assert text.startswith("#!/bin/sh") and "-m hpct_slurm.cli prolog" in text
    assert os.stat(scripts["prolog"]).st_mode & 0o111
    # the script runs as written: no job id, so the CLI says so, and exits 0 (a hook that
    # cannot do its work lets the job run: issue 43)
    out = subprocess.run([str(scripts["epilog"])], env={}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "SLURM_JOB_ID is not set" in out.stderr
    # a python that is gone (a venv removed under a running slurmd) does not fail the job
    (tmp_path / "venv").mkdir()
    os.symlink(sys.executable, tmp_path / "venv" / "python")
    gone = install_hooks(tmp_path / "gone", str(tmp_path / "venv" / "python"), {})
    os.unlink(tmp_path / "venv" / "python")
    out = subprocess.run([str(gone["prolog"])], env={}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "is not there; the job runs without it" in out.stderr
    with pytest.raises(HpctError, match="not an HPCT_"):
        install_hooks(tmp_path / "h2", sys.executable, {"LD_PRELOAD": "/x"})
    with pytest.raises(HpctError, match="not an HPCT_"):
        install_hooks(tmp_path / "h2", sys.executable, {"HPCT_SHM_FRACTON": "0.5"})  # a typo
    with pytest.raises(HpctError, match="HPCT_SHM_FRACTION '2' is not a number in"):
        install_hooks(tmp_path / "h2", sys.executable, {"HPCT_SHM_FRACTION": "2"})
    with pytest.raises(HpctError, match="absolute path"):
        install_hooks(tmp_path / "h3", "python3")


def test_hooks_install_writes_the_tmpfiles_line_that_makes_the_shm_root_at_boot(tmp_path,
                                                                               capsys):
    """Issue 30: any user could create /dev/shm/hpct (a link, a directory of theirs) before
    the first Prolog after boot, and the Prolog then drains the node (test above). `hooks
    install` ships the boot-time creation: a tmpfiles.d line, in the dir --tmpfiles-dir
    names (default /etc/tmpfiles.d), for the shm root the hooks are set to use."""
    import shutil

    from hpct_slurm.cli import main

    etc = tmp_path / "etc" / "tmpfiles.d"
    assert main(["hooks", "install", str(tmp_path / "hooks"), "--tmpfiles-dir", str(etc)]) == 0
    conf = etc / "hpct-slurm.conf"
    assert conf.read_text().splitlines()[-1] == "d /dev/shm/hpct 0755 root root -"
    assert stat.S_IMODE(os.stat(conf).st_mode) == 0o644
    out = capsys.readouterr()
    assert f"wrote {conf}" in out.err and "Prolog=" in out.out
    # the root the hooks are set to use, quoted the way systemd-tmpfiles reads a path
    odd = "/dev/shm/it's 100% \"ours\""
    assert main(["hooks", "install", str(tmp_path / "hooks"), "--tmpfiles-dir", str(etc),
                 "--set", f"HPCT_SHM_ROOT={odd}"]) == 0
    assert conf.read_text().splitlines()[-1] == \
        'd "/dev/shm/it\'s 100%% \\"ours\\"" 0755 root root -'
    assert main(["hooks", "install", str(tmp_path / "h2"), "--no-tmpfiles",
                 "--tmpfiles-dir", str(tmp_path / "not-written")]) == 0
    assert not (tmp_path / "not-written").exists()
    if shutil.which("systemd-tmpfiles") and os.geteuid() == 0:
        # what boot does, under another root: the directory the Prolog then accepts
        boot = tmp_path / "boot"
        boot.mkdir()  # systemd 262 (Debian sid) refuses a --root that does not exist
        subprocess.run(["systemd-tmpfiles", "--create", f"--root={boot}", str(conf)],
                       check=True, capture_output=True, timeout=60)
        made = boot / odd.lstrip("/")
        st_ = os.stat(made, follow_symlinks=False)
        assert stat.S_ISDIR(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o755
        assert st_.st_uid == 0
        res = prolog(_job(), HookConfig(shm_root=made, min_free_shm_mb=1), RecordingSlurm(),
                     _log(tmp_path))
        assert res.healthy and res.job_dir == made / "42"


def test_plugstack_line_refuses_whitespace():
    assert plugstack_line(Path("/p.so"), hpct="/b/hpct-slurm", max_spares=4) == \
        "required /p.so max_spares=4 hpct=/b/hpct-slurm"
    with pytest.raises(HpctError):
        plugstack_line(Path("/p.so"), hpct="/a b")


def test_task_prolog_leaves_the_controllers_settings_to_the_controller():
    """Issue 14: the rendezvous derivation's timeouts (for steps nobody supervises) must not
    overwrite what the controller handed to the ranks it launched."""
    from hpct_slurm.hooks.task_prolog import CONTROLLER_OWNED, for_task

    derived = {"MASTER_ADDR": "n1", "HPCT_COLLECTIVE_TIMEOUT_S": "120",
               "HPCT_INIT_TIMEOUT_S": "600"}
    assert for_task(dict(derived), {}) == derived  # a plain srun step keeps them
    ranks = for_task(dict(derived), {"HPCT_CONTROLLER": "10.0.0.1:4000"})
    assert ranks == {"MASTER_ADDR": "n1"}
    assert set(CONTROLLER_OWNED) == set(derived) - set(ranks)


def test_a_failed_plugin_build_shows_the_compilers_message():
    """Issue 43: on a minimal image without libc6-dev, make's last line ("make: *** [...]
    Error 1") hid the reason."""
    out = ("hpct_spank.c:3:10: fatal error: errno.h: No such file or directory\n"
           "    3 | #include <errno.h>\n      |          ^~~~~~~~~\ncompilation terminated.\n"
           "make: *** [Makefile:12: /tmp/hpct_spank.so] Error 1\n")
    assert compiler_message(out) == ("hpct_spank.c:3:10: fatal error: errno.h: No such file or "
                                     "directory")
    two = "a.c:1: error: x\nb.c:2: error: y\nmake: *** [all] Error 1\n"
    assert compiler_message(two) == "a.c:1: error: x (and 1 more error lines)"
    assert compiler_message("ld: cannot find -lslurm\nmake: *** [all] Error 1") == \
        "ld: cannot find -lslurm"
    assert compiler_message("") == "no output"
