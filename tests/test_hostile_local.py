"""Hostile local input, issue 30 section 3: what is bound to its place on disk. A persisted
snapshot's MAC binds its kind (a shard key's shared state, or a rank's own), its rank and its
step, so a genuine file moved or copied to another place is refused, naming what disagreed."""
from __future__ import annotations

import json
import shutil
import struct

import pytest

from hpct_slurm.errors import HpctError
from hpct_slurm.events import EventLog, read_events
from hpct_slurm.recovery import persist

SECRET = b"k" * 32


@pytest.fixture(scope="module")
def snap():
    import torch

    from hpct_slurm.recovery.snapshot import SnapshotStore
    from hpct_slurm.recovery.state import TrainState

    torch.manual_seed(0)
    return SnapshotStore(TrainState(model=torch.nn.Linear(4, 4))).commit(1)


def _write(root, snap, rank: int, step: int):
    return persist.write_snapshot(root, rank, step, snap.layout, snap.data, snap.digest(),
                                  key=SECRET)


def test_a_shared_state_file_copied_into_persist_rank_is_refused(tmp_path, snap):
    """The shared state of shard key 1 at step 20, copied to where rank 1's own state of step
    20 belongs: a genuine file, MACed with the job's secret, once loaded as the rank's own."""
    shared = _write(tmp_path / "persist", snap, 1, 20)
    own = _write(tmp_path / "persist-rank", snap, 1, 10)
    assert persist.load_latest(tmp_path / "persist", 1, key=SECRET)[0] == 20  # still read
    planted = persist.rank_dir(tmp_path / "persist-rank", 1) / "step20.bin"
    shutil.copy(shared, planted)
    with pytest.raises(HpctError, match=r"step20.bin' holds shared state of shard key 1 at "
                                        r"step 20 where rank state of rank 1 at step 20 belongs: "
                                        r"its kind disagrees with its place"):
        persist.read_snapshot(planted, 1, key=SECRET)
    events = EventLog(tmp_path / "events.jsonl")
    step, _, _ = persist.load_latest(tmp_path / "persist-rank", 1, events=events, key=SECRET)
    assert step == 10  # the rank's own older file, not the planted one
    [corrupt] = [e for e in read_events(tmp_path / "events.jsonl")
                 if e["event"] == "persist.corrupt"]
    assert corrupt["step"] == 20 and "its kind disagrees" in corrupt["error"]
    # and the other way round: a rank's own state is no shard key's shared state
    shutil.copy(own, persist.rank_dir(tmp_path / "persist", 1) / "step30.bin")
    with pytest.raises(HpctError, match="holds rank state of rank 1 at step 10 where shared "
                                        "state of shard key 1 at step 30 belongs"):
        persist.read_snapshot(persist.rank_dir(tmp_path / "persist", 1) / "step30.bin", 1,
                              key=SECRET)


def test_a_file_renamed_to_another_step_or_rank_is_refused(tmp_path, snap):
    root = tmp_path / "persist-rank"
    src = _write(root, snap, 0, 4)
    renamed = src.with_name("step8.bin")
    shutil.copy(src, renamed)
    with pytest.raises(HpctError, match="its step disagrees"):
        persist.read_snapshot(renamed, 0, key=SECRET)
    moved = persist.rank_dir(root, 2) / "step4.bin"
    moved.parent.mkdir()
    shutil.copy(src, moved)
    with pytest.raises(HpctError, match="its rank disagrees"):
        persist.read_snapshot(moved, 2, key=SECRET)
    assert persist.read_snapshot(src, 0, key=SECRET)[0] == 4


def test_a_file_of_the_format_without_its_kind_is_refused_by_name(tmp_path, snap):
    """HPCTSNP3 (before the kind was bound): genuine, but it cannot say which kind it is."""
    meta = json.dumps({"rank": 0, "step": 2, "digest": snap.digest().hex(),
                       "layout": json.loads(snap.layout.to_json())}).encode()
    head = b"HPCTSNP3" + struct.pack(">I", len(meta)) + meta
    old = persist.rank_dir(tmp_path / "persist-rank", 0) / "step2.bin"
    old.parent.mkdir(parents=True)
    old.write_bytes(head + persist._mac(SECRET, head) + bytes(snap.data))
    with pytest.raises(HpctError, match="format HPCTSNP3 with no kind .* reads only HPCTSNP4"):
        persist.read_snapshot(old, 0, key=SECRET)
