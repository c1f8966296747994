"""The NCCL branches of tearing a group down and of a STOP, driven on CPU (issue 26, items 1-2).

No GPU here: a real 1-rank gloo group stands in, and the branch is chosen as it is for NCCL
(`pg.backend_name` answers "nccl"). Everything else is torch's own code: the abort of every
group, the destroy, the group tables, the group counter. The `gpu` tier (test_gpu.py) runs the
same on a real NCCL group where a GPU is lent.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hpct_slurm import protocol as P
from hpct_slurm.events import EventLog
from hpct_slurm.recovery.client import ControllerAddress, CoordinationClient
from hpct_slurm.rendezvous import pg
from hpct_slurm.rendezvous.derive import derive
from hpct_slurm.rendezvous.store import make_store, serve_shard
from hpct_slurm.slurm.env import SlurmEnv

JOB = "4711"
SECRET = b"s" * 32


def _env() -> SlurmEnv:
    return SlurmEnv.from_environ({
        "SLURM_JOB_ID": JOB, "SLURM_JOB_NODELIST": "n0", "SLURMD_NODENAME": "n0",
        "SLURM_STEP_NODELIST": "n0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"})


def _form(generation: int):
    """One generation of a 1-rank group over the rootless store, as Job forms it."""
    info = derive(_env(), generation, ["n0"], tasks_per_node=1,
                  resolve=lambda name: "127.0.0.1")
    shard = serve_shard(info, SECRET)
    store = make_store("rootless", info, SECRET)
    pg.init(info, store, "gloo", shard=shard)
    return info, shard


@pytest.fixture
def as_nccl(monkeypatch):
    """The group's backend as teardown and abort see it: NCCL (a mock of the GPU boundary)."""
    monkeypatch.setattr(pg, "backend_name", lambda: "nccl")
    # and torch's own answer, for code that asks torch (what teardown asked before the seam)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    yield
    if dist.is_initialized():  # a failed test must not leave a group for the next one
        monkeypatch.undo()
        pg.teardown()


def _shard_serves(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_torch_abort_of_every_group_already_destroys_them():
    """The torch fact behind item 1: destroy after the abort asserts, so teardown must not."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    c10d._abort_process_group()
    assert not dist.is_initialized() and c10d._world.pg_map == {}
    with pytest.raises(AssertionError, match="Process group cannot be None"):
        dist.destroy_process_group()
    c10d._world.group_count = 0


def test_nccl_teardown_leaves_nothing_formed_and_the_next_generation_forms(as_nccl):
    info, shard = _form(0)
    port = shard.port
    assert _shard_serves(port)
    pg.teardown()  # before the fix: AssertionError from destroy_process_group()
    assert not dist.is_initialized() and pg.current() is None
    assert c10d._world.pg_map == {} and c10d._world.group_count == 0
    assert not _shard_serves(port)
    # the next generation forms in the same process and its collective works
    info, _ = _form(1)
    assert pg.current().generation == 1
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    pg.teardown()
    assert not dist.is_initialized() and c10d._world.group_count == 0


def test_a_stops_abort_reaches_only_the_generation_it_names(as_nccl, monkeypatch):
    aborted: list[object] = []
    real_abort = torch._C._distributed_c10d.ProcessGroup.abort

    def spy(self):
        aborted.append(self)
        return real_abort(self)

    monkeypatch.setattr(torch._C._distributed_c10d.ProcessGroup, "abort", spy)
    _form(1)
    sub = dist.new_group([0])  # a mesh's sub-group is aborted with the world
    assert pg.abort_generation(0) is False and aborted == []  # an older generation's STOP
    assert pg.abort_generation(1) is True
    assert set(aborted) == {dist.group.WORLD, sub}
    # Only aborted: the main thread, whatever dist call it is in, still finds its groups;
    # teardown (from the main thread) destroys them.
    assert dist.is_initialized() and pg.current().generation == 1
    pg.teardown()  # its NCCL branch aborts again (harmless) and destroys
    assert not dist.is_initialized() and c10d._world.group_count == 0
    aborted.clear()
    assert pg.abort_generation(1) is False and aborted == []  # nothing formed: nothing to do


def test_gloo_groups_are_never_aborted_by_a_stop(monkeypatch):
    """gloo's blocked reads end when the STOP cuts their sockets; its abort is not needed."""
    calls = []
    monkeypatch.setattr(torch._C._distributed_c10d.ProcessGroup, "abort",
                        lambda self: calls.append(self))
    _form(0)
    try:
        assert pg.backend_name() == "gloo"
        assert pg.abort_generation(0) is False and calls == []
    finally:
        pg.teardown()


class _Controller:
    """Just enough of a controller to send a rank STOPs: accepts one connection, reads its
    Register, then sends what the test asks."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.conn: socket.socket | None = None
        self.chan = None
        self._ready = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.conn, _ = self.listener.accept()
        self.chan = P.server_hello(self.conn, SECRET, JOB, timeout=5)
        self.chan.recv(self.conn, timeout=5)  # the Register
        self._ready.set()

    def send(self, msg) -> None:
        assert self._ready.wait(5)
        self.chan.send(self.conn, msg)

    def close(self) -> None:
        for s in (self.conn, self.listener):
            if s is not None:
                s.close()


@pytest.fixture
def rank(tmp_path):
    ctl = _Controller()
    client = CoordinationClient(ControllerAddress(*ctl.address), SECRET, JOB,
                                EventLog(tmp_path / "events.jsonl"))
    client.generation = 2
    calls: list[tuple[str, int]] = []
    client.abort_comms = lambda g: calls.append((threading.current_thread().name, g)) or True
    client.register("n0", 0, "active", "127.0.0.1", 4000)
    yield ctl, client, calls, tmp_path / "events.jsonl"
    client.close()
    ctl.close()


def _text(path) -> str:
    return path.read_text() if path.exists() else ""


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_stop_naming_lost_nodes_aborts_its_generation_from_the_receiving_thread(rank):
    ctl, client, calls, events = rank
    ctl.send(P.Stop(2, "node n3 lost", ["10.77.0.13"]))
    _wait(lambda: calls)
    # at once, on the abort thread the receiving thread starts and watches (the main thread
    # here does nothing: it could be blocked in a collective)
    assert calls == [("hpct-comm-abort", 2)]
    _wait(lambda: "rank.aborted" in _text(events))
    assert client.stop_event.is_set() and client.stop_generation == 2


def test_a_planned_stop_aborts_nothing(rank):
    ctl, client, calls, _ = rank
    ctl.send(P.Stop(2, "move n1 to s0"))  # no lost nodes: ranks leave at a step boundary
    _wait(client.stop_event.is_set)
    time.sleep(0.2)
    assert calls == []


def test_an_abort_that_hangs_makes_the_rank_leave_within_its_deadline(rank):
    ctl, client, _, events = rank
    release = threading.Event()
    client.abort_comms = lambda g: release.wait(30)
    client.abort_timeout_s = 0.3
    hung: list[str] = []
    client.on_abort_hung = hung.append
    t0 = time.monotonic()
    ctl.send(P.Stop(2, "node n3 lost", ["10.77.0.13"]))
    _wait(lambda: hung)
    assert time.monotonic() - t0 < 3
    assert "did not finish within 0.3 s" in hung[0]
    assert "rank.abort_hung" in _text(events)
    release.set()


def test_an_abort_that_fails_is_recorded_and_recovery_goes_on(rank):
    ctl, client, _, events = rank

    def fails(generation: int) -> bool:
        raise RuntimeError("ncclInternalError")

    client.abort_comms = fails
    ctl.send(P.Stop(2, "node n3 lost", ["10.77.0.13"]))
    _wait(lambda: "rank.abort_failed" in _text(events))
    assert "ncclInternalError" in _text(events)
    assert client.stop_event.is_set()
