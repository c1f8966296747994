"""Forming and re-forming the default process group, one generation at a time.

Rules learnt the hard way (torch-distributed.md):
- every generation rendezvouses under its own key prefix: destroy_process_group() resets the
  group counter, so a new generation's keys would otherwise collide with the old one's;
- initialise with a long timeout (a replacement may be slow to join), then shorten the
  collective timeout on the formed group; with lazy gloo pairs the long wait is a barrier of
  our own (`_pair_timeout`);
- tear down outside any `except` block: the traceback keeps the broken group (and gloo's
  sockets) alive, the peers never hear of it and hang for the default 30 minutes.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import sys
import threading
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as dist_c10d
from torch.distributed.distributed_c10d import _abort_process_group, _set_pg_timeout

from ..errors import HpctError
from . import gather, gloo_wake
from .derive import RendezvousInfo
from .store import ShardServer

# Read by the backends when a group is created; set from the derived env unless the user (or
# the task prolog) already exported them.
_BACKEND_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCH_GLOO_LAZY_INIT",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
                "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")


@dataclasses.dataclass
class _Formed:
    info: RendezvousInfo
    store: dist.Store
    shard: ShardServer | None
    # The Python store the group's C++ PrefixStore calls into. C++ holds only the native
    # half of a Python-defined store: once the Python object is collected, every later call
    # (a DeviceMesh's new_group, after init) fails inside torch with "Not implemented".
    # So it lives as long as the group.
    gathering: gather.FormationStore | None = None


_formed: _Formed | None = None
# The gathering store of a formation in progress: what a STOP's wake_connecting() reads.
_forming: "gather.FormationStore | None" = None
# Held while the default group changes hands (formed, aborted, destroyed): a STOP's abort runs
# on the thread that receives it, while the main thread may be tearing the same group down.
_lock = threading.Lock()


def generation_prefix(generation: int) -> str:
    return f"hpct/gen{generation}"


def nccl_id_prefix(generation: int, group_name: str = "0") -> str:
    """The store prefix of a group's NCCL unique-id keys (torch 2.13): the generation's prefix
    (init's PrefixStore), the group's name (`_new_process_group_helper`'s
    PrefixStore(f"{group_name}/"), "0" for the default group since the group count starts
    from 0 every generation), the device's (PrefixStore("cuda/")); ProcessGroupNCCL then sets
    `<counter>` under it on rank 0 and every other rank gets it (fanout.py)."""
    return f"{generation_prefix(generation)}/{group_name}//cuda//"


def gloo_lazy() -> bool:
    """Whether torch will make this process's gloo groups with lazy pairs."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "0").strip().lower() in ("1", "true", "yes")


def _pair_timeout(collective_timeout: datetime.timedelta) -> datetime.timedelta:
    """The timeout gloo pairs get from init: a fifth of the collective timeout.

    gloo copies the group's timeout at init into every pair and never updates it
    (_set_pg_timeout reaches only the collectives), and a pair's first connect waits up to
    5x that timeout on its listening side (tcp/pair.h waitUntil, torch 2.13's gloo: "Connect
    timeout"). With the init timeout there, a peer that died before it connected kept a
    survivor for 5 x 600 s. Init itself waits for nobody in lazy mode; the wait for a slow
    rank is FormationStore's barrier, under the store's (init) timeout."""
    return max(collective_timeout / 5, datetime.timedelta(milliseconds=1))


def current() -> RendezvousInfo | None:
    """The generation this process's default group belongs to, if one is formed."""
    return _formed.info if _formed else None


def init(info: RendezvousInfo, store: dist.Store, backend: str = "gloo",
         init_timeout: datetime.timedelta | None = None,
         collective_timeout: datetime.timedelta | None = None, *,
         shard: ShardServer | None = None,
         device_id: "int | None" = None,
         on_exchanged: "Callable[[], None] | None" = None) -> dist.ProcessGroup:
    """Form the default group of `info`'s generation over `store`.

    `shard`: this node's shard server, if this process runs it; teardown() stops it.
    `on_exchanged`: called once this process has read the members' addresses (gloo's exchange
    through a gathering store), before its pairs connect (test fault injection: inject.py).
    """
    global _formed, _forming
    if dist.is_initialized():
        raise HpctError(f"a process group is already formed (generation "
                        f"{current().generation if current() else '?'}): teardown() first")
    init_timeout = init_timeout or datetime.timedelta(seconds=info.init_timeout_s)
    collective_timeout = collective_timeout or datetime.timedelta(
        seconds=info.collective_timeout_s)
    env = info.env()
    for name in _BACKEND_ENV:
        if name in env:
            os.environ.setdefault(name, env[name])
    fan_out = getattr(store, "fan_out", None)
    if "nccl" in backend and fan_out is not None:
        # The world communicator's id is read by every rank: a copy on every node's shard,
        # each rank reads its own. With the device bound (device_id), torch creates subgroups
        # by splitting the world communicator (ncclCommSplit, where NCCL supports it), which
        # sets no id in the store; a script that creates communicators otherwise declares
        # their prefixes the same way (nccl_id_prefix with the group's name).
        fan_out(nccl_id_prefix(info.generation), range(len(info.store_endpoints)))
    # gloo's address exchange in one round trip instead of 2N (gather.py), during init only.
    gathering = gather.FormationStore(store, info.rank, info.world_size) if gather.wraps(
        store) else None
    if gathering is not None and on_exchanged is not None:
        fetch = gathering._fetch

        def fetch_then_tell(*args: object) -> list[bytes]:
            out = fetch(*args)
            on_exchanged()
            return out

        gathering._fetch = fetch_then_tell  # type: ignore[method-assign]
    prefixed = dist.PrefixStore(generation_prefix(info.generation), gathering or store)
    kwargs = {} if device_id is None else {"device_id": device_id}
    # gloo's pairs get a shorter timeout wherever our store carries the long wait for a slow
    # rank: the gathered address exchange waits for every rank under the store's (init)
    # timeout, abortable by a STOP, before any pair connects (full mesh), or the barrier
    # below does (lazy pairs). A pair's connect then waits for its peer at most 5x its
    # timeout on the listening side (tcp/pair.h), for a member that died after it wrote its
    # address: with the init timeout there (30 s), survivors sat 150 s in connectFullMesh,
    # past the controller's 60 s wait for them (issue 30: healthy nodes fenced "not ready
    # (forming)"). Full mesh: the collective timeout (at most 50 s there): a rank connects its
    # pairs one after another, so a busy node gets more room than lazy pairs' fifth of it.
    # Lazy pairs: see _pair_timeout. A STOP in that connect phase wakes the waiting pairs
    # (wake_connecting), so the full mesh's timeout only bounds a rank nobody stopped.
    lazy = backend == "gloo" and gathering is not None and gloo_lazy()
    if lazy:
        group_timeout = _pair_timeout(collective_timeout)
    elif backend == "gloo" and gathering is not None:
        group_timeout = min(init_timeout, collective_timeout)
    else:
        group_timeout = init_timeout
    try:
        with _lock:
            _forming = gathering
        dist.init_process_group(backend, store=prefixed, rank=info.rank,
                                world_size=info.world_size, timeout=group_timeout, **kwargs)
        if gathering is not None:
            gathering.finish(barrier=lazy)
    except BaseException:
        if gathering is not None:
            gathering.plan.finish()  # nothing more to send for a formation that failed
        if dist.is_initialized():
            dist.destroy_process_group()  # lazy: the barrier failed; no pair connected yet
        # A failed formation (aborted by a STOP, a member gone, a timeout) must leave nothing
        # behind: no store connections, no shard server, and no advanced group counter.
        _release(_Formed(info, store, shard))
        _reset_group_count()
        raise
    finally:
        with _lock:
            _forming = None
    group = dist.group.WORLD
    if collective_timeout != group_timeout:
        _set_pg_timeout(collective_timeout, group)
    with _lock:
        _formed = _Formed(info, store, shard, gathering)
    return group


def set_collective_timeout(seconds: float) -> None:
    """The formed world group's collectives wait this long from now on (gloo's pairs keep
    the timeout they were made with: see _pair_timeout)."""
    _set_pg_timeout(datetime.timedelta(seconds=seconds), dist.group.WORLD)


def wake_connecting() -> tuple[int, int]:
    """For the thread that receives a STOP: wake every gloo pair of the formation in progress
    in this process that still waits in native code for its peer (gloo_wake.py), so that
    init returns now instead of after 5x the pair timeout: the pairs that listen (how many
    were woken) and the pairs whose connect is in flight (how many attempts were reset: a
    peer whose SYNs the network drops). (0, 0) when no formation is in its connect phase here
    (none in progress, the exchange not done, not gloo's tcp)."""
    with _lock:
        forming = _forming
    if forming is None:
        return 0, 0
    plan = forming.plan
    own = plan.own_gloo_value
    if own is None:
        return 0, 0  # the exchange is not over: the store's abort ends it
    try:
        published = gloo_wake.parse(own, plan.world_size)
    except ValueError:
        return 0, 0  # not the gloo this was written for: its own timeout ends the wait
    woken = gloo_wake.wake(published, plan.rank, range(plan.world_size))
    peers = gloo_wake.listeners(plan.gloo_values, plan.world_size, plan.rank)

    def still_forming() -> bool:
        with _lock:
            return _forming is forming
    return woken, gloo_wake.reset_connects(peers, still_forming)


def backend_name() -> str:
    """The formed default group's backend as torch names it ("gloo", "nccl",
    "cpu:gloo,cuda:nccl"). A seam: the CPU tests take the NCCL branches of teardown() and
    abort_generation() with a real gloo group by naming it "nccl" here."""
    return str(dist.get_backend())


def needs_abort(backend: str) -> bool:
    """Whether a group of `backend` must be aborted rather than only destroyed: an NCCL
    communicator waiting on a dead peer has no socket to close (InfiniBand, NVLink), and
    destroying it waits for that peer."""
    return "nccl" in backend


def abort_generation(generation: int) -> bool:
    """Abort the communicators of every group of `generation` (or older) still formed here,
    now: for the thread that receives a STOP naming lost nodes. A main thread blocked on their
    work (a collective, a CUDA wait) then fails at once instead of after NCCL's watchdog
    timeout, and goes to recovery as a gloo rank does once `sever` cut its sockets.

    Only aborts: torch's group tables stay as they are, so the main thread, whatever dist
    call it is in, sees an aborted group and not a vanished one; teardown() then destroys them.
    All groups are aborted inside one NCCL group call, as torch's own _abort_process_group()
    does (communicators aborted one by one can deadlock each other: pytorch#119797).
    False when there was nothing to abort: no group, another generation's, or a backend
    (gloo) whose blocked reads the STOP's socket cut already ends."""
    with _lock:
        formed = _formed
        if formed is None or formed.info.generation > generation or not dist.is_initialized():
            return False
        if not needs_abort(backend_name()):
            return False
        groups = sorted(dist_c10d._world.pg_names, key=lambda g: dist_c10d._world.pg_names[g],
                        reverse=True)
        nccl = _nccl_backend(dist.group.WORLD)
        if nccl is not None:
            nccl._group_start()
        try:
            for group in groups:
                group.abort()
        finally:
            if nccl is not None:
                nccl._group_end()
        return True


def _nccl_backend(group: "dist.ProcessGroup | None") -> "object | None":
    """The group's NCCL backend object, if it has one (what brackets an abort of several
    communicators in one NCCL group call)."""
    nccl_class = getattr(dist_c10d, "ProcessGroupNCCL", None)  # absent from CPU builds
    if group is None or nccl_class is None or not dist.is_nccl_available():
        return None
    try:
        backend = group._get_backend(torch.device("cuda"))
    except RuntimeError:
        return None
    return backend if isinstance(backend, nccl_class) else None


def teardown() -> None:
    """Destroy the default group, close the store, stop this node's shard. Never blocks on
    peers: gloo's sockets close with the group, NCCL communicators are aborted first.

    Call it after leaving the `except` block that caught the failure, and after dropping every
    object that holds the group (a DDP module's reducer does).
    """
    global _formed
    if sys.exc_info()[0] is not None:
        raise HpctError("teardown() called inside an except block: the traceback keeps the "
                        "broken group's sockets open and the peers hang; leave the except block "
                        "first (record the error, then tear down)")
    with _lock:
        formed, _formed = _formed, None
        if dist.is_initialized():
            if needs_abort(backend_name()):
                # Aborts every communicator and, with no group given, also destroys every
                # group and resets torch's tables (torch 2.11-2.13): nothing is left for
                # destroy_process_group(), which would assert on the missing default group.
                _abort_process_group()
            if dist.is_initialized():
                dist.destroy_process_group()
    # The group's destructor is what closes gloo's sockets: make sure it runs now.
    gc.collect()
    if formed is not None:
        _release(formed)
    _reset_group_count()


def _release(formed: _Formed) -> None:
    close = getattr(formed.store, "close", None)
    if close is not None:
        close()
    if formed.shard is not None:
        formed.shard.stop()


def _reset_group_count() -> None:
    """torch names unnamed groups by a process-wide counter that only destroy_process_group()
    resets, and only when a group exists. A formation that failed half-way advances it
    anyway; the survivors of that attempt would then rendezvous under other key names
    (".../gen2/1//...") than a fresh spare (".../gen2/0//...") and never meet. Every
    generation therefore starts from 0, whatever happened to the last one."""
    if not dist.is_initialized():
        dist_c10d._world.group_count = 0
