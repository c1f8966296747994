"""An admin's `hpct-slurm move` runs as root on a job of another user: the request must be
the job user's to read (the controller runs as that user) and the dir it lies in theirs to
write again (a rank's own move-out of a corrupted node goes there too). And a requests dir
the controller cannot list is said, not read as "no request"."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import hpct_slurm
from hpct_slurm import move_requests as M
from hpct_slurm.errors import HpctError
from test_controller_fast import FakeCluster, run

USER = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (two uids)")
# What the job's user (its controller, a rank) sees of the requests, and whether a request
# of its own still goes in beside an admin's.
AS_USER = """
import json, os, sys
from pathlib import Path
from hpct_slurm import move_requests as M  # first: root's interpreter may lie in /root
os.setgroups([]); os.setgid(65534); os.setuid(65534)
run_dir = Path(sys.argv[1])
try:
    seen = [[f.name, node, reason, why] for f, node, reason, why in M.read_requests(run_dir)]
except Exception as exc:
    seen = f"{type(exc).__name__}: {exc}"
try:
    M.ask_move(run_dir, "a2", "replicas disagree")
    own = "ok"
except Exception as exc:
    own = f"{type(exc).__name__}: {exc}"
print(json.dumps({"seen": seen, "own": own}))
"""


@pytest.fixture
def users_run_dir():
    """A run dir of uid 65534 (0700, a secret) where that user can reach it: outside the
    test's own 0700 tmp dir."""
    base = Path(tempfile.mkdtemp(prefix="hpct-mv-"))
    os.chmod(base, 0o755)
    run_dir = base / "hpct-7"
    run_dir.mkdir(mode=0o700)
    (run_dir / "secret").write_bytes(b"s" * 32)
    for p in (run_dir, run_dir / "secret"):
        os.chown(p, USER, USER)
    yield run_dir
    subprocess.run(["rm", "-rf", "--", str(base)], check=True)


def _as_user(run_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(hpct_slurm.__file__).parent.parent)}
    out = subprocess.run([sys.executable, "-c", AS_USER, str(run_dir)], capture_output=True,
                         text=True, timeout=60, env=env, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@needs_root
def test_roots_request_is_the_run_dir_owners_and_the_users_go_on(users_run_dir):
    path = M.ask_move(users_run_dir, "a1", "asked by the admin")
    d = users_run_dir / M.REQUESTS
    for p, mode in ((d, 0o700), (path, 0o600)):
        st = p.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (USER, USER, mode), p
    got = _as_user(users_run_dir)
    assert got == {"seen": [["move-a1", "a1", "asked by the admin", ""]], "own": "ok"}
    assert sorted(os.listdir(d)) == ["move-a1", "move-a2"]


@needs_root
def test_roots_request_fails_as_the_owner_would(users_run_dir):
    """The checks are the owner's: a requests dir another user could write is refused,
    by name, in root's command."""
    d = users_run_dir / M.REQUESTS
    d.mkdir(mode=0o700)
    os.chown(d, USER, USER)
    os.chmod(d, 0o777)
    with pytest.raises(HpctError, match=r"requests dir .* is owned by uid 65534 with mode 0777"):
        M.ask_move(users_run_dir, "a1", "asked by the admin")


@needs_root
def test_a_requests_dir_its_user_cannot_list_is_an_error_not_no_request(users_run_dir):
    d = users_run_dir / M.REQUESTS
    d.mkdir(mode=0o700)  # root's, as an admin's `move` made it before
    (d / "move-a1").write_text("asked by the admin")
    got = _as_user(users_run_dir)
    assert got["seen"].startswith("HpctError: HPCT: requests dir ")
    assert "Permission denied" in got["seen"] and "owned by uid 0, mode 0700" in got["seen"]
    assert "Permission denied" in got["own"]


def test_the_controller_says_once_that_it_cannot_list_the_requests(tmp_path, monkeypatch):
    from hpct_slurm.controller import lifecycle

    why = "requests dir /x/requests cannot be read (Permission denied)"

    def unreadable(run_dir):
        raise HpctError(why)
    monkeypatch.setattr(lifecycle, "read_requests", unreadable)

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 3)
            await c.until(lambda: c.events("move.requests_unreadable"), "the event")
            await c.train(["localhost", "a1"], 6)
            [ev] = c.events("move.requests_unreadable")
            assert ev["why"] == why
            assert await c.finish() == 0
    run(scenario)
