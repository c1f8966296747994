"""Rendezvous without a single root: layout/ports/env from SLURM_*, a sharded store, and
process-group (re-)formation per generation.

This module imports no torch (the CLI imports it); `init_from_slurm` loads torch when called.

Knobs read from the environment (all optional; hpct_slurm/config.py describes each, scope
"rendezvous"): HPCT_MEMBERS, HPCT_TASKS_PER_NODE, HPCT_GENERATION, HPCT_PORT_BASE,
HPCT_PORT_SPAN, HPCT_NODES_PER_HOST, HPCT_SOCKET_IFNAME, and HPCT_STORE, HPCT_SECRET_FILE for
the store.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .. import config as C
from ..errors import HpctError
from ..events import Ev
# The submodule, not its function: `from hpct_slurm.rendezvous import derive` must stay the
# module that callers use as `derive.derive(...)`, `derive.resolve_host(...)`.
from . import derive
from .derive import RendezvousInfo

if TYPE_CHECKING:
    from ..events import EventLog

__all__ = ["RendezvousInfo", "derive_from_environ", "init_from_slurm"]

# What a training script reads to learn where it sits; exported into os.environ on init.
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
             "MASTER_PORT", C.GENERATION, C.STORE_PORT)


def derive_from_environ(generation: int | None = None,
                        environ: Mapping[str, str] | None = None,
                        **overrides: object) -> RendezvousInfo:
    """`derive` with SLURM_* and the HPCT_* knobs of `environ` (default os.environ);
    keyword `overrides` win over both (members=, tasks_per_node=, resolve=, ...)."""
    from ..slurm.env import SlurmEnv
    from ..slurm.hostlist import expand

    environ = os.environ if environ is None else environ
    env = SlurmEnv.from_environ(environ)
    if generation is None:
        generation = C.read(environ, C.GENERATION)
    port_base = C.read(environ, C.PORT_BASE)
    port_span = C.read(environ, C.PORT_SPAN)
    nodes_per_host = C.read(environ, C.NODES_PER_HOST)
    if C.raw(environ, C.PORT_BASE) or C.raw(environ, C.PORT_SPAN):
        # Each is in range on its own; together they must still fit below 65536.
        try:
            derive.check_port_range(port_base, port_span, nodes_per_host or 1)
        except HpctError as exc:
            raise C.SettingError(f"{C.PORT_BASE}={port_base} with {C.PORT_SPAN}={port_span}: "
                                 f"{exc.message}") from None
    kwargs: dict[str, object] = {
        "port_base": port_base,
        "port_span": port_span,
        "nodes_per_host": nodes_per_host,
        "ifname": C.read(environ, C.SOCKET_IFNAME),
        "tasks_per_node": C.read(environ, C.TASKS_PER_NODE),
    }
    members = C.read(environ, C.MEMBERS)
    if members:
        try:
            kwargs["members"] = expand(members)
        except HpctError as exc:
            raise C.SettingError(f"{C.MEMBERS} {members!r} is not a hostlist "
                                 f"({exc.message})") from None
    kwargs.update(overrides)
    return derive.derive(env, generation, **kwargs)  # type: ignore[arg-type]


def init_from_slurm(generation: int = 0, backend: str = "gloo", *,
                    store_kind: str | None = None, secret_file: str | None = None,
                    environ: Mapping[str, str] | None = None, events: "EventLog | None" = None,
                    **overrides: object) -> RendezvousInfo:
    """Everything from the environment in one call: derive this process's place in
    `generation`, start the node's shard server (local rank 0), build the store, form the
    default process group. `rendezvous.pg.teardown()` undoes it (the shard server too).
    """
    import torch

    from . import pg
    from .store import load_secret, make_store, serve_shard

    environ = os.environ if environ is None else environ
    info = derive_from_environ(generation, environ, **overrides)
    kind = store_kind or C.read(environ, C.STORE)
    secret = load_secret(secret_file) if kind == "rootless" else None
    shard = serve_shard(info, secret, events=events) if (
        kind == "rootless" and info.local_rank == 0) else None
    try:
        store = make_store(kind, info, secret)  # type: ignore[arg-type]
        device_id = None
        if backend == "nccl":
            device_id = info.local_rank % max(1, torch.cuda.device_count())
            torch.cuda.set_device(device_id)
        env = info.env()
        os.environ.update({k: env[k] for k in _RANK_ENV})
        pg.init(info, store, backend, shard=shard, device_id=device_id)
    except BaseException:
        if shard is not None:
            shard.stop()
        raise
    if events is not None:
        events.emit(Ev.RENDEZVOUS_FORMED, generation=info.generation, rank=info.rank,
                    world_size=info.world_size, node=info.node_name, store=kind)
    return info
