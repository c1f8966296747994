"""Issue 45: a rank kept the soft descriptor limit of 1,024 and a local user's 1,500 idle
connections to gloo's unauthenticated listener aborted it (`accept: Too many open files`).
Ranks, the controller and the relay raise the soft limit to the hard one at start, and
`rank.registered` says what they ended with (and warns below the floor)."""
from __future__ import annotations

import json
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
