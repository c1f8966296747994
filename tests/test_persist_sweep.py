"""Issue 45.6: a save cut short by a crash left `.stepN.bin.<hex>.tmp` in the persist dir (7
of 52 fault runs) and nothing removed it. The next save removes such leftovers of this rank
dir, and only those: never a save in progress (its writer holds the file locked), never a file
of another name, never through a link."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpct_slurm.recovery import persist

SECRET = b"k" * 32
# A save killed (SIGKILL) inside its write: what a crashed node leaves.
KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    from hpct_slurm.recovery import persist
    from hpct_slurm.recovery.snapshot import SnapshotStore
    from hpct_slurm.recovery.state import TrainState

    snap = SnapshotStore(TrainState(model=torch.nn.Linear(512, 1024))).commit(7)
    persist._write_direct = lambda fd, data: os.kill(os.getpid(), signal.SIGKILL)
    persist.write_snapshot(sys.argv[1], 0, 7, snap.layout, snap.data, snap.digest(),
                           key=b"k" * 32)
""")


@pytest.fixture(scope="module")
def snap():
    import torch

    from hpct_slurm.recovery.snapshot import SnapshotStore
    from hpct_slurm.recovery.state import TrainState

    return SnapshotStore(TrainState(model=torch.nn.Linear(4, 4))).commit(8)


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_the_next_save_removes_what_a_killed_save_left_and_nothing_else(tmp_path, snap):
    root = tmp_path / "persist"
    out = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(root)], capture_output=True,
                         timeout=120)
    assert out.returncode == -9, out.stderr.decode()
    d = persist.rank_dir(root, 0)
    (left,) = [p for p in d.iterdir()]
    assert left.name.startswith(".step7.bin.") and left.name.endswith(".tmp")
    _age(left, 3600)

    in_progress = d / ".step9.bin.0123456789ab.tmp"   # a live writer's, old but locked
    in_progress.write_bytes(b"x")
    _age(in_progress, 3600)
    held = open(in_progress, "rb")
    fcntl.flock(held.fileno(), fcntl.LOCK_EX)
    fresh = d / ".step9.bin.ba9876543210.tmp"         # just created: its writer locks it next
    fresh.write_bytes(b"x")
    other = d / "notes.tmp"                            # not a save's name
    other.write_bytes(b"x")
    _age(other, 3600)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    link = d / ".step5.bin.aaaaaaaaaaaa.tmp"           # a link: never touched
    os.symlink(target, link)
    os.utime(link, (0, 0), follow_symlinks=False)

    persist.write_snapshot(root, 0, 8, snap.layout, snap.data, snap.digest(), key=SECRET)
    names = sorted(p.name for p in d.iterdir())
    assert names == sorted([".step5.bin.aaaaaaaaaaaa.tmp", ".step9.bin.0123456789ab.tmp",
                            ".step9.bin.ba9876543210.tmp", "notes.tmp", "step8.bin"])
    assert target.read_bytes() == b"keep"
    held.close()   # its writer is gone now: the next save takes it
    persist.write_snapshot(root, 0, 9, snap.layout, snap.data, snap.digest(), key=SECRET)
    assert ".step9.bin.0123456789ab.tmp" not in {p.name for p in d.iterdir()}
    assert persist.load_latest(root, 0, key=SECRET)[0] == 9


def test_a_persisters_close_removes_what_a_killed_save_left_of_its_rank(tmp_path, snap):
    """The job's end: the rank holding the key closes its persister within the minute a
    killed save's temp file is spared by saves, and no later save comes to remove it."""
    from hpct_slurm.recovery.snapshot import SnapshotStore
    from hpct_slurm.recovery.state import TrainState
    import torch

    root = tmp_path / "persist"
    out = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(root)], capture_output=True,
                         timeout=120)
    assert out.returncode == -9, out.stderr.decode()
    d = persist.rank_dir(root, 0)
    (left,) = d.iterdir()
    _age(left, 10)  # a spare's takeover of the killed rank's key takes seconds
    store = SnapshotStore(TrainState(model=torch.nn.Linear(4, 4)))
    persister = persist.DiskPersister(store, root, rank=0, every=1, key=SECRET)
    store.commit(8)
    persister.after_commit(8)
    persister.flush()
    assert len([p for p in d.iterdir() if p.name.endswith(".tmp")]) == 1  # fresh: spared
    persister.close()
    assert sorted(p.name for p in d.iterdir()) == ["step8.bin"]


# A rank whose script ends (an exception, sys.exit) while a save is being written, without
# the Job's shutdown: the interpreter's exit would stop the writer thread where it was.
EXIT_MID_SAVE = textwrap.dedent("""
    import sys, time
    import torch
    from hpct_slurm.recovery import persist
    from hpct_slurm.recovery.snapshot import SnapshotStore
    from hpct_slurm.recovery.state import TrainState

    slow = persist._write_direct
    def write(fd, data):
        print("writing", flush=True)
        time.sleep(1.0)
        slow(fd, data)
    persist._write_direct = write
    store = SnapshotStore(TrainState(model=torch.nn.Linear(512, 1024)))
    p = persist.DiskPersister(store, sys.argv[1], rank=0, every=1, key=b"k" * 32)
    store.commit(3)
    p.after_commit(3)
    time.sleep(0.5)
    raise SystemExit("the script's own end")
""")


def test_an_exit_without_close_finishes_the_save_in_progress(tmp_path):
    root = tmp_path / "persist"
    out = subprocess.run([sys.executable, "-c", EXIT_MID_SAVE, str(root)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "writing" in out.stdout, out.stderr
    assert sorted(p.name for p in persist.rank_dir(root, 0).iterdir()) == ["step3.bin"]
    assert persist.load_latest(root, 0, key=SECRET)[0] == 3
