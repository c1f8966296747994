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

from ..errors import HpctError, shown
from .hostlist import MAX_HOSTS, expand

# ASCII digits only (\d and str.isdigit also take '١'), and short enough that int() is cheap.
_UINT_RE = re.compile(r"[0-9]{1,10}")
_TASKS_ITEM_RE = re.compile(r"([0-9]{1,10})(?:\(x([0-9]{1,10})\))?")
_PORTS_RE = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")
# Slurm job ids are uint32 from 1; a leading zero would give one job two names (and two shm
# dirs). The one rule for every place that takes a job id from outside.
JOB_ID_RE = re.compile(r"[1-9][0-9]{0,9}")
UINT32_MAX = 0xFFFFFFFF


def check_job_id(value: str | int, what: str = "job id") -> int:
    """`value` as a Slurm job id, or HpctError naming `what` (e.g. the variable) and the value."""
    text = str(value)
    if not JOB_ID_RE.fullmatch(text) or int(text) > UINT32_MAX:
        raise HpctError(f"{what} {shown(text)} is not a Slurm job id (a decimal number "
                        f"1..{UINT32_MAX} without leading zeros)")
    return int(text)


def check_uint(value: str, name: str) -> int:
    """`value` of variable `name` as a non-negative integer that fits 32 bits, ASCII digits
    only, or HpctError naming the variable."""
    if not _UINT_RE.fullmatch(value) or int(value) > UINT32_MAX:
        raise HpctError(f"{name} {shown(value)} is not a non-negative integer "
                        f"(at most {UINT32_MAX})")
    return int(value)


def parse_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's compressed tasks-per-node form, `2(x3),1` -> [2, 2, 2, 1]. The number of nodes
    is checked before the list is built: `1(x1000000000)` is refused, not allocated."""
    items: list[tuple[int, int]] = []
    for item in value.split(","):
        m = _TASKS_ITEM_RE.fullmatch(item)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise HpctError(f"{name} {shown(value)} is not a tasks-per-node list like "
                            f"'2(x3),1'")
        items.append((int(m.group(1)), int(m.group(2) or 1)))
    nodes = sum(repeat for _, repeat in items)
    if nodes > MAX_HOSTS:
        raise HpctError(f"{name} {shown(value)} describes {nodes} nodes, more than the "
                        f"{MAX_HOSTS} a job can have")
    return [count for count, repeat in items for _ in range(repeat)]


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
        return check_uint(value, name)

    def step_id(self, name: str) -> int | None:
        """A step id: a number, or (Slurm 26.05 on) one of Slurm's special steps written as a
        negative number (the batch script's SLURM_STEP_ID is '-5'), read as Slurm's own
        unsigned id (SLURM_BATCH_SCRIPT, 0xfffffffb), what older releases print for it."""
        value = self.environ.get(name)
        if value in SPECIAL_STEP_IDS:
            return SPECIAL_STEP_IDS[value]
        return self.uint(name)

    def hosts(self, name: str) -> list[str] | None:
        value = self.environ.get(name)
        if value is None:
            return None
        try:
            return expand(value)
        except HpctError as exc:
            raise HpctError(f"{name} {shown(value)} is not a hostlist ({exc.message})") from None

    def ports(self, name: str) -> tuple[int, int] | None:
        value = self.environ.get(name)
        if value is None:
            return None
        m = _PORTS_RE.fullmatch(value)
        lo = int(m.group(1)) if m else -1
        hi = int(m.group(2)) if m and m.group(2) else lo
        if not m or not 0 < lo <= hi <= 65535:
            raise HpctError(f"{name} {shown(value)} is not a port or a port range like "
                            f"'12000-12004'")
        return lo, hi


# Slurm's special step ids (slurm.h), as Slurm 26.05 writes them into SLURM_STEP_ID: signed.
SPECIAL_STEP_IDS = {
    "-3": 0xfffffffd,  # SLURM_PENDING_STEP
    "-4": 0xfffffffc,  # SLURM_EXTERN_CONT
    "-5": 0xfffffffb,  # SLURM_BATCH_SCRIPT
    "-6": 0xfffffffa,  # SLURM_INTERACTIVE_STEP
}


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
        if "SLURM_JOB_ID" not in r.environ:
            raise HpctError("SLURM_JOB_ID is not set: not inside a Slurm job")
        job_id = check_job_id(r.environ["SLURM_JOB_ID"], "SLURM_JOB_ID")
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
            step_id=r.step_id("SLURM_STEP_ID"),
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
    """The rules Slurm itself keeps between the variables; a set that breaks one was not
    written by Slurm, and a rank that trusted it would join the wrong rendezvous slot."""
    if env.ntasks == 0:
        raise HpctError("SLURM_NTASKS '0' is not a task count (a step has at least one task)")
    if env.procid is not None and env.ntasks is not None and env.procid >= env.ntasks:
        raise HpctError(f"SLURM_PROCID '{env.procid}' is not below SLURM_NTASKS '{env.ntasks}'")
    if (env.tasks_per_node is not None and tpn_nodes is not None
            and len(env.tasks_per_node) != len(tpn_nodes)):
        raise HpctError(f"{tpn_var} {shown(environ[tpn_var])} gives {len(env.tasks_per_node)} "
                        f"nodes but the step has {len(tpn_nodes)}")
    if env.step_nodelist is not None:
        job_nodes = set(env.job_nodelist)
        outside = next((n for n in env.step_nodelist if n not in job_nodes), None)
        if outside is not None:
            raise HpctError(f"SLURM_STEP_NODELIST {shown(environ['SLURM_STEP_NODELIST'])} "
                            f"names {outside}, which is not in SLURM_JOB_NODELIST "
                            f"{shown(environ['SLURM_JOB_NODELIST'])}")
    if env.node_name is not None:
        for var, nodes in (("SLURM_JOB_NODELIST", env.job_nodelist),
                           ("SLURM_STEP_NODELIST", env.step_nodelist)):
            if nodes is not None and env.node_name not in nodes:
                raise HpctError(f"SLURMD_NODENAME {shown(env.node_name)} is not in {var} "
                                f"{shown(environ[var])}")
    step_nodes = env.step_nodelist
    if env.nodeid is not None and step_nodes is not None and env.nodeid >= len(step_nodes):
        raise HpctError(f"SLURM_NODEID '{env.nodeid}' is not below the {len(step_nodes)} "
                        f"nodes of SLURM_STEP_NODELIST "
                        f"{shown(environ['SLURM_STEP_NODELIST'])}")
    _check_localid(env, environ, tpn_var, tpn_nodes)


def _check_localid(env: SlurmEnv, environ: Mapping[str, str], tpn_var: str,
                   tpn_nodes: list[str] | None) -> None:
    """SLURM_LOCALID must be below this node's task count in the tasks-per-node list."""
    if env.localid is None or env.tasks_per_node is None:
        return
    # This node's place in the list: SLURM_NODEID, else SLURMD_NODENAME's position.
    if env.nodeid is not None:
        index = env.nodeid
    elif env.node_name is not None and tpn_nodes is not None and env.node_name in tpn_nodes:
        index = tpn_nodes.index(env.node_name)
    else:
        return
    if index >= len(env.tasks_per_node):
        raise HpctError(f"SLURM_NODEID '{index}' is not below the {len(env.tasks_per_node)} "
                        f"nodes of {tpn_var} {shown(environ[tpn_var])}")
    tasks = env.tasks_per_node[index]
    if env.localid >= tasks:
        raise HpctError(f"SLURM_LOCALID '{env.localid}' is not below the {tasks} task(s) that "
                        f"{tpn_var} {shown(environ[tpn_var])} gives this node (node {index})")
