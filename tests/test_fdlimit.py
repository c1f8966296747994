"""Issue 45: a rank kept the soft descriptor limit of 1,024 and a local user's 1,500 idle
connections to gloo's unauthenticated listener aborted it (`accept: Too many open files`).
Ranks, the controller and the relay raise the soft limit to the hard one at start, and
`rank.registered` says what they ended with (and warns below the floor)."""
from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys

import pytest

from hpct_slurm import fdlimit
from tests import test_job_seams as seams

settings = seams.settings  # the fixture: a Job's frozen settings in tmp_path

SOFT, HARD = resource.getrlimit(resource.RLIMIT_NOFILE)


@pytest.fixture
def low_soft():
    """The distribution's usual soft limit (1,024) under this machine's hard one."""
    if HARD != resource.RLIM_INFINITY and HARD <= 1024:
        pytest.skip(f"the hard limit here is {HARD}: nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, HARD))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, HARD))


def test_raise_nofile_takes_the_hard_limit(low_soft):
    was, soft, hard = fdlimit.raise_nofile()
    assert (was, hard) == (1024, HARD)
    assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 1024
    assert ("fd_limit_low" in fdlimit.nofile_fields((was, soft, hard))) == (soft < 4096)


def test_a_rank_registers_with_the_raised_limit(low_soft, settings):
    job, _ = seams._job(settings)
    job.run(lambda step: 0.0, 3)
    events = [json.loads(line) for f in (settings.run_dir / "events").iterdir()
              for line in f.read_text().splitlines()]
    reg = next(e for e in events if e["event"] == "rank.registered")
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert now > 1024
    assert reg["fd_limit"] == {"soft": now, "hard": HARD, "was": 1024}


def test_a_low_hard_limit_is_reported():
    """A hard limit below the floor cannot be raised by the process: the record says so."""
    code = ("import json, resource; from hpct_slurm import fdlimit; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (512, 2048)); "
            "print(json.dumps(fdlimit.nofile_fields(fdlimit.raise_nofile())))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], check=True,
                                    capture_output=True, text=True).stdout)
    assert out["fd_limit"] == {"soft": 2048, "hard": 2048, "was": 512}
    assert "below 4096" in out["fd_limit_low"] and "docs/admin.md" in out["fd_limit_low"]


# Two gloo ranks on loopback, started with the usual soft limit of 1,024; `raise` makes them
# do what a rank does at start (Job._start). Each prints its listening port once formed, waits
# for the attack, then all-reduces again.
_RANK = """
import os, sys, time, torch, torch.distributed as dist
from hpct_slurm import fdlimit
rank, path, raise_it = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "raise"
if raise_it:
    fdlimit.raise_nofile()
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                        timeout=__import__("datetime").timedelta(seconds=60))
t = torch.ones(2); dist.all_reduce(t)
print("formed", flush=True)
sys.stdin.readline()  # the attack is over
t = torch.ones(2); dist.all_reduce(t)
print("alive", t.tolist(), flush=True)
# as a rank ends (pg.teardown): a process that exits with the group still up may abort in
# gloo's destructors ("terminate called without an active exception", CI, after "alive")
dist.destroy_process_group()
"""
_ATTACK = """
import socket, sys
held = []
for port in map(int, sys.argv[1:]):
    for _ in range(1500):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), 5))
        except OSError as exc:
            print("refused", exc); break
print("held", len(held), flush=True)
"""


def _gloo_ranks_under_attack(tmp_path, how: str) -> list[str]:
    """1,500 idle connections from uid 65534 to rank 0's gloo listener (issue 45's attack)."""
    def low():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, HARD))
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(tmp_path / "store"),
                               how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, preexec_fn=low)
             for r in range(2)]
    try:
        for p in ranks:
            assert p.stdout.readline().strip() == "formed"
        ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
        ports = [line.split()[3].rsplit(":", 1)[1] for line in ss.splitlines()
                 if f"pid={ranks[0].pid}," in line]
        attack = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                 sys.executable, "-c", _ATTACK, *ports],
                                capture_output=True, text=True, timeout=120)
        assert f"held {1500 * len(ports)}" in attack.stdout, attack.stdout + attack.stderr
        for p in ranks:  # both at once: the all-reduce needs both
            with contextlib.suppress(BrokenPipeError):  # one the attack aborted
                p.stdin.write("\n")
                p.stdin.flush()
        out = []
        for p in ranks:
            rest = p.communicate(timeout=120)[0]
            out.append(f"{p.returncode} {rest.strip()}")
        return out
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.skipif(os.geteuid() != 0 or HARD <= 4096,
                    reason="needs root (setpriv to uid 65534) and a hard limit above 4,096")
def test_idle_connections_to_gloo_abort_a_rank_only_at_the_old_limit(tmp_path):
    old = _gloo_ranks_under_attack(tmp_path, "keep")
    assert old[0].startswith("-6 ") and "Too many open files" in old[0]  # SIGABRT, as measured
    (tmp_path / "store").unlink(missing_ok=True)
    assert _gloo_ranks_under_attack(tmp_path, "raise") == [
        "0 alive [2.0, 2.0]", "0 alive [2.0, 2.0]"]
