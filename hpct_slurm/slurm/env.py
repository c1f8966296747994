"""The SLURM_* environment of a job, a batch script or a step task, parsed once and checked.

Parsing is pure: `SlurmEnv.from_environ(mapping)` reads only the mapping it is given, so every
case is testable without a cluster. A wrong value fails here, naming the variable and its value,
rather than later as a rank that joins the wrong rendezvous.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from ..errors import HpctError
from .hostlist import expand

_TASKS_ITEM_RE = re.compile(r"(\d+)(?:\(x(\d+)\))?")
_PORTS_RE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's compressed tasks-per-node form, `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in value.split(","):
        m = _TASKS_ITEM_RE.fullmatch(item)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise HpctError(f"{name} {value!r} is not a tasks-per-node list like '2(x3),1'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def format_tasks_per_node(counts: list[int]) -> str:
    """The inverse of parse_tasks_per_node, written the way Slurm writes it."""
    parts = []
    for i, c in enumerate(counts):
        if parts and counts[i - 1] == c:
            continue
        run = 1
        while i + run < len(counts) and counts[i + run] == c:
            run += 1
        parts.append(f"{c}(x{run})" if run > 1 else str(c))
    return ",".join(parts)


class _Reader:
    """Typed access to one environment mapping; every error names the variable and value."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ

    def str(self, name: str) -> str | None:
        value = self.environ.get(name)
        return value if value else None

    def uint(self, name: str) -> int | None:
        value = self.environ.get(name)
        if value is None:
            return None
        if not value.isdecimal() or not value.isascii():
            raise HpctError(f"{name} {value!r} is not a non-negative integer")
        return int(value)

    def hosts(self, name: str) -> list[str] | None:
        value = self.environ.get(name)
        if value is None:
            return None
        try:
            return expand(value)
        except HpctError as exc:
            raise HpctError(f"{name} {value!r} is not a hostlist ({exc.message})") from None

    def ports(self, name: str) -> tuple[int, int] | None:
        value = self.environ.get(name)
        if value is None:
            return None
        m = _PORTS_RE.fullmatch(value)
        lo = int(m.group(1)) if m else -1
        hi = int(m.group(2)) if m and m.group(2) else lo
        if not m or not 0 < lo <= hi <= 65535:
            raise HpctError(f"{name} {value!r} is not a port or a port range like '12000-12004'")
        return lo, hi


@dataclass(frozen=True)
class SlurmEnv:
    """What Slurm told this process about its job, step and task."""

    job_id: int
    job_name: str | None
    job_nodelist: list[str]
    job_num_nodes: int
    node_name: str | None
    step_id: int | None
    step_nodelist: list[str] | None
    procid: int | None
    localid: int | None
    nodeid: int | None
    ntasks: int | None
    tasks_per_node: list[int] | None
    cpus_on_node: int | None
    restart_count: int
    step_resv_ports: tuple[int, int] | None
    submit_dir: str | None
    # Slurm runs the batch script on the first node of the allocation.
    batch_host: str | None

    @property
    def in_step(self) -> bool:
        """True in a task launched by srun (as opposed to the batch script or a prolog)."""
        return self.procid is not None and self.step_nodelist is not None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "SlurmEnv":
        """Parse `environ` (default: os.environ) or raise HpctError naming the bad variable."""
        r = _Reader(os.environ if environ is None else environ)
        job_id = r.uint("SLURM_JOB_ID")
        if job_id is None:
            raise HpctError("SLURM_JOB_ID is not set: not inside a Slurm job")
        nodelist = r.hosts("SLURM_JOB_NODELIST")
        if nodelist is None:
            raise HpctError("SLURM_JOB_NODELIST is not set: not inside a Slurm allocation")
        num_nodes = r.uint("SLURM_JOB_NUM_NODES")
        if num_nodes is not None and num_nodes != len(nodelist):
            raise HpctError(f"SLURM_JOB_NUM_NODES '{num_nodes}' does not match the "
                            f"{len(nodelist)} nodes of SLURM_JOB_NODELIST "
                            f"{r.environ['SLURM_JOB_NODELIST']!r}")
        step_nodelist = r.hosts("SLURM_STEP_NODELIST")
        if "SLURM_STEP_TASKS_PER_NODE" in r.environ:
            tpn_var = "SLURM_STEP_TASKS_PER_NODE"
            tpn_nodes = step_nodelist
        else:
            # Inside a step Slurm rewrites SLURM_TASKS_PER_NODE to the step's layout.
            tpn_var = "SLURM_TASKS_PER_NODE"
            tpn_nodes = step_nodelist if step_nodelist is not None else nodelist
        tasks_per_node = (parse_tasks_per_node(r.environ[tpn_var], tpn_var)
                          if tpn_var in r.environ else None)
        env = cls(
            job_id=job_id,
            job_name=r.str("SLURM_JOB_NAME"),
            job_nodelist=nodelist,
            job_num_nodes=len(nodelist),
            node_name=r.str("SLURMD_NODENAME"),
            step_id=r.uint("SLURM_STEP_ID"),
            step_nodelist=step_nodelist,
            procid=r.uint("SLURM_PROCID"),
            localid=r.uint("SLURM_LOCALID"),
            nodeid=r.uint("SLURM_NODEID"),
            ntasks=r.uint("SLURM_NTASKS"),
            tasks_per_node=tasks_per_node,
            cpus_on_node=r.uint("SLURM_CPUS_ON_NODE"),
            restart_count=r.uint("SLURM_RESTART_COUNT") or 0,
            step_resv_ports=r.ports("SLURM_STEP_RESV_PORTS"),
            submit_dir=r.str("SLURM_SUBMIT_DIR"),
            batch_host=nodelist[0],
        )
        _check_consistent(env, r.environ, tpn_var, tpn_nodes)
        return env


def _check_consistent(env: SlurmEnv, environ: Mapping[str, str], tpn_var: str,
                      tpn_nodes: list[str] | None) -> None:
    if env.procid is not None and env.ntasks is not None and env.procid >= env.ntasks:
        raise HpctError(f"SLURM_PROCID '{env.procid}' is not below SLURM_NTASKS '{env.ntasks}'")
    if (env.tasks_per_node is not None and tpn_nodes is not None
            and len(env.tasks_per_node) != len(tpn_nodes)):
        raise HpctError(f"{tpn_var} {environ[tpn_var]!r} gives {len(env.tasks_per_node)} "
                        f"nodes but the step has {len(tpn_nodes)}")
    if env.node_name is not None:
        for var, nodes in (("SLURM_JOB_NODELIST", env.job_nodelist),
                           ("SLURM_STEP_NODELIST", env.step_nodelist)):
            if nodes is not None and env.node_name not in nodes:
                raise HpctError(f"SLURMD_NODENAME {env.node_name!r} is not in {var} "
                                f"{environ[var]!r}")
    step_nodes = env.step_nodelist
    if env.nodeid is not None and step_nodes is not None and env.nodeid >= len(step_nodes):
        raise HpctError(f"SLURM_NODEID '{env.nodeid}' is not below the {len(step_nodes)} "
                        f"nodes of SLURM_STEP_NODELIST {environ['SLURM_STEP_NODELIST']!r}")
