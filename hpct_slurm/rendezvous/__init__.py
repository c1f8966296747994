"""Rendezvous without a single root: layout/ports/env from SLURM_*, a sharded store, and
process-group (re-)formation per generation.

This module imports no torch (the CLI imports it); `init_from_slurm` loads torch when called.

Knobs read from the environment (all optional):
  HPCT_MEMBERS          hostlist of the generation's member nodes, in rank order (set by the
                        controller; unset: the step's own nodes, plain srun)
  HPCT_TASKS_PER_NODE   tasks on each member (unset: the step's own)
  HPCT_GENERATION       generation for `hpct-slurm rendezvous env` (default 0)
  HPCT_PORT_BASE, HPCT_PORT_SPAN, HPCT_NODES_PER_HOST, HPCT_SOCKET_IFNAME
  HPCT_STORE            rootless (default) | tcpstore
  HPCT_SECRET_FILE      per-job secret of the rootless store
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import HpctError
from ..events import Ev
# The submodule, not its function: `from hpct_slurm.rendezvous import derive` must stay the
# module that callers use as `derive.derive(...)`, `derive.resolve_host(...)`.
from . import derive
from .derive import DEFAULT_PORT_BASE, DEFAULT_PORT_SPAN, RendezvousInfo

if TYPE_CHECKING:
    from ..events import EventLog

__all__ = ["RendezvousInfo", "derive_from_environ", "init_from_slurm"]

# What a training script reads to learn where it sits; exported into os.environ on init.
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "HPCT_GENERATION", "HPCT_STORE_PORT")


_INT = re.compile(r"-?[0-9]+")
_MAX_PORT = 65535
_MIN_PORT_BASE = 1024


def _int_env(environ: Mapping[str, str], name: str, lo: int = 0,
             hi: int | None = None) -> int | None:
    """$name as an int in lo..hi, None when unset or empty. A value that is set but out of
    range is an error naming the variable, never a silent fall-back to the default."""
    value = environ.get(name)
    if value is None or value == "":
        return None
    if not _INT.fullmatch(value.strip()):
        raise HpctError(f"{name} {value!r} is not a non-negative integer")
    number = int(value)
    if number < lo or (hi is not None and number > hi):
        allowed = f"at least {lo}" if hi is None else f"in {lo}-{hi}"
        raise HpctError(f"{name}={value} is out of range: it must be {allowed} "
                        f"(unset it for the default)")
    return number


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


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
        generation = _or(_int_env(environ, "HPCT_GENERATION"), 0)
    port_base = _or(_int_env(environ, "HPCT_PORT_BASE", _MIN_PORT_BASE, _MAX_PORT),
                    DEFAULT_PORT_BASE)
    port_span = _or(_int_env(environ, "HPCT_PORT_SPAN", derive.GENERATION_WINDOW,
                             _MAX_PORT - _MIN_PORT_BASE + 1), DEFAULT_PORT_SPAN)
    nodes_per_host = _int_env(environ, "HPCT_NODES_PER_HOST", 1)
    if environ.get("HPCT_PORT_BASE") or environ.get("HPCT_PORT_SPAN"):
        # Each is in range on its own; together they must still fit below 65536.
        try:
            derive.check_port_range(port_base, port_span, nodes_per_host or 1)
        except HpctError as exc:
            raise HpctError(f"HPCT_PORT_BASE={port_base} with HPCT_PORT_SPAN={port_span}: "
                            f"{exc.message}") from None
    kwargs: dict[str, object] = {
        "port_base": port_base,
        "port_span": port_span,
        "nodes_per_host": nodes_per_host,
        "ifname": environ.get("HPCT_SOCKET_IFNAME") or None,
        "tasks_per_node": _int_env(environ, "HPCT_TASKS_PER_NODE", 1),
    }
    if environ.get("HPCT_MEMBERS"):
        try:
            kwargs["members"] = expand(environ["HPCT_MEMBERS"])
        except HpctError as exc:
            raise HpctError(f"HPCT_MEMBERS {environ['HPCT_MEMBERS']!r} is not a hostlist "
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
    kind = store_kind or environ.get("HPCT_STORE") or "rootless"
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
