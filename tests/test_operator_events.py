"""Issue 45.4: every event docs/troubleshooting.md lists appears only where it says, and a
rank's fault says where the script raised it.

* `transfer.bad_frame` blames "something other than the job": a peer's connection cut
  mid-frame by a crash is `transfer.connection_lost` instead (real loopback TCP).
* `rank.mesh_inferred` follows every `rank.registered` that said `undecided`, 1-D FSDP too.
* `rank.fault`'s `where` names the script's own line when torch's frames fill the innermost
  ones, and the full traceback goes to the rank's log (its stdout).
"""
from __future__ import annotations

import socket
import struct

import torch

from hpct_slurm import protocol as P
from hpct_slurm.examples.train import wrong_shape
from hpct_slurm.recovery.replicas import ReplicaStore
from hpct_slurm.recovery.snapshot import SnapshotStore
from hpct_slurm.recovery.state import TrainState
from hpct_slurm.recovery.transfer import TransferServer, push_replica
from test_job_rooms import _group, nothing_formed_after  # noqa: F401  (a fixture)
from test_transfer import Events, wait_for

SECRET = b"k" * 32
JOB = "77"


def _store() -> SnapshotStore:
    model = torch.nn.Linear(16, 16)
    return SnapshotStore(TrainState(model=model,
                                    optimizer=torch.optim.SGD(model.parameters(), 0.1)))


def _cut(sock: socket.socket) -> None:
    """The process dies: its kernel resets the connection (SO_LINGER 0), as a crashed
    process's often is."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_pusher_cut_mid_frame_by_a_crash_is_a_lost_connection_not_a_bad_frame():
    own = _store()
    own.commit(3)
    events = Events()
    with TransferServer(SECRET, JOB, 1, replicas=ReplicaStore(), events=events.log) as srv:
        sock = socket.create_connection(srv.address, timeout=5)
        chan = P.client_hello(sock, SECRET, JOB, 5)
        with own.lease(3) as snap:
            push_replica(sock, chan, 0, snap, timeout=5)   # an authenticated ring neighbour
        sock.sendall(b"\x00\x00")                          # its next frame, cut by its death
        _cut(sock)
        (lost,) = wait_for(events, "transfer.connection_lost")
        assert lost["authenticated"] is True and lost["peer"].startswith("127.0.0.1:")
        assert events.named("transfer.bad_frame") == []

        # a stranger's malformed frame is still a bad frame
        with socket.create_connection(srv.address, timeout=5) as stranger:
            stranger.recv(P.NONCE_BYTES)
            stranger.sendall(struct.pack(">I", 10) + b"x" * (10 + P.MAC_LEN))
            stranger.recv(16)
        assert wait_for(events, "transfer.bad_frame")


def test_where_names_the_scripts_line_under_torchs_frames(capsys):
    from hpct_slurm.recovery import fault_trace

    try:
        wrong_shape()
    except RuntimeError as exc:
        where = fault_trace.record(exc)
    frames = where.split(" < ")
    assert frames[0].startswith("linear.py:") and frames[-2] == "..."
    assert frames[-1].startswith("train.py:") and frames[-1].endswith(" in wrong_shape")
    out = capsys.readouterr().out
    assert "a fault ended this rank's generation" in out
    assert 'train.py", line' in out and "in wrong_shape" in out
    assert out.rstrip().endswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied "
                                 "(2x5 and 3x4)")

    try:  # raised by the script itself: its frame is the innermost, said once
        raise RuntimeError("boom")
    except RuntimeError as exc:
        where = fault_trace.where(exc)
    assert where.startswith("test_operator_events.py:") and "..." not in where


def test_a_1d_fsdp_build_says_its_mode_as_rank_registered_promised(tmp_path,
                                                                    nothing_formed_after):
    """rank.registered says `undecided` for a sharded job without replicate=...; its first
    model decides, and rank.mesh_inferred says so. 1-D FSDP (every parameter sharded on the
    one dimension: nothing replicated) used to decide in silence."""
    from torch.distributed.fsdp import fully_shard

    def build(mesh):
        model = torch.nn.Linear(4, 4)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    group, policy, events = _group(tmp_path, build=build, mesh=(1,))
    group.form(P.Assign(0, 0, 1, ["localhost"], 1, -1))
    assert group.mesh_spec.replicate == ()
    said = events.named("rank.mesh_inferred")
    assert [(e["replicate"], e["mode"]) for e in said] == [([], policy.mode)]
    group.release()
    group.teardown()
