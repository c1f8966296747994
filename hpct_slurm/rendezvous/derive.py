"""Rank layout, addresses, ports and Gloo/NCCL environment of one generation, from SLURM_*.

The controller launches one `srun -N1 -w node` step per node, so a step's own SLURM_PROCID and
SLURM_NTASKS only describe that node. The global layout comes from the controller's membership
for the generation (ordered member nodes, tasks per node); without it (plain `srun` spanning the
nodes) the step's own SLURM_* describe the whole world.

Everything here is a pure function of its arguments except `resolve_host` and
`ifname_for_address`, which `derive` takes as parameters so the logic can be tested without a
cluster.
"""
from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .. import config as C
from ..errors import HpctError

if TYPE_CHECKING:
    from ..slurm.env import SlurmEnv

# Below the Linux ephemeral range (32768-60999), so outgoing connections never hold our ports.
DEFAULT_PORT_BASE = 20000
DEFAULT_PORT_SPAN = 8192
# Consecutive generations within this window get distinct ports, so a new generation never
# races the old generation's lingering listeners.
GENERATION_WINDOW = 8
# Real clusters give every node its own host. Only a one-machine test cluster (all slurmd on one
# address) needs more than one port per (job, generation) on a host.
DEFAULT_NODES_PER_HOST = 1
DEFAULT_INIT_TIMEOUT_S = 600.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0

SIOCGIFADDR = 0x8915


@dataclasses.dataclass(frozen=True)
class RendezvousInfo:
    """Where this process sits in one generation, and how to reach everyone else."""

    job_id: int
    generation: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    node_name: str
    members: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    # Per member, in member order: the address and the port of that node's store shard.
    # Ports depend only on what every member agrees on (job, generation, membership), never
    # on SLURM_JOB_NODELIST, which shrinks for steps launched after a node failure.
    addresses: tuple[str, ...]
    store_ports: tuple[int, ...]
    master_addr: str
    master_port: int
    ifname: str | None
    init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    @property
    def store_endpoints(self) -> list[tuple[str, int]]:
        return list(zip(self.addresses, self.store_ports))

    @property
    def store_port(self) -> int:
        """The port this node's shard server listens on."""
        return self.store_ports[self.node_rank]

    def env(self) -> dict[str, str]:
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            # 2 = abort the communicator but keep the process: survivors must stay resident
            # (1 would tear the whole process down on the first peer failure).
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
            "TORCH_NCCL_BLOCKING_WAIT": "0",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(self.init_timeout_s)),
            # Eager full mesh by default: after init nobody needs the store again, and a fault
            # finds only open sockets, which fail at once. A lazy pair's first connect to a
            # SIGKILLed peer left the rank stuck in 2 of 6 probe runs (architecture.md,
            # "Forming a group"). Lazy pairs form a 64-rank group ~3x faster
            # (docs/benchmarks.md): opt-in, HPCT_GLOO_LAZY_INIT=1.
            "TORCH_GLOO_LAZY_INIT": "1" if C.read(None, C.GLOO_LAZY_INIT) else "0",
            C.GENERATION: str(self.generation),
            C.STORE_PORT: str(self.store_port),
            C.INIT_TIMEOUT_S: _fmt_seconds(self.init_timeout_s),
            C.COLLECTIVE_TIMEOUT_S: _fmt_seconds(self.collective_timeout_s),
        }
        if self.ifname:
            env["GLOO_SOCKET_IFNAME"] = self.ifname
            env["NCCL_SOCKET_IFNAME"] = self.ifname
        return env

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _fmt_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def check_port_range(port_base: int, port_span: int, nodes_per_host: int) -> None:
    if nodes_per_host < 1:
        raise HpctError(f"nodes_per_host {nodes_per_host!r} must be at least 1")
    if not 1024 <= port_base <= 65535:
        raise HpctError(f"port_base {port_base!r} must lie in 1024-65535")
    if port_span < 1 or port_base + port_span - 1 > 65535:
        raise HpctError(f"port_span {port_span!r} from port_base {port_base} runs past 65535")
    if port_span < GENERATION_WINDOW * nodes_per_host:
        raise HpctError(
            f"port_span {port_span!r} is too small: it needs at least "
            f"{GENERATION_WINDOW * nodes_per_host} ports ({GENERATION_WINDOW} generations x "
            f"{nodes_per_host} nodes per host)")


def job_window(port_span: int, nodes_per_host: int = DEFAULT_NODES_PER_HOST) -> int:
    """Jobs whose ids differ by less than this never share a port."""
    return (port_span // nodes_per_host) // GENERATION_WINDOW


def derived_port(job_id: int, generation: int, host_slot: int, *,
                 port_base: int = DEFAULT_PORT_BASE, port_span: int = DEFAULT_PORT_SPAN,
                 nodes_per_host: int = DEFAULT_NODES_PER_HOST) -> int:
    """The store port of one node of a job in one generation, when Slurm reserved none.

    The range is cut into blocks of `nodes_per_host` ports; (job, generation) picks the block,
    the node's slot among the members on its host picks the port inside it. Two jobs whose ids
    differ by less than `job_window(...)` never share a block, and neither do two generations
    of one job less than GENERATION_WINDOW apart.
    """
    check_port_range(port_base, port_span, nodes_per_host)
    if job_id < 0:
        raise HpctError(f"job_id {job_id!r} must not be negative")
    if generation < 0:
        raise HpctError(f"generation {generation!r} must not be negative")
    if not 0 <= host_slot < nodes_per_host:
        raise HpctError(f"host_slot {host_slot!r} must lie in 0-{nodes_per_host - 1}")
    n_blocks = port_span // nodes_per_host
    block = (job_id * GENERATION_WINDOW + generation % GENERATION_WINDOW) % n_blocks
    return port_base + block * nodes_per_host + host_slot


def reserved_port(resv_ports: tuple[int, int], generation: int, host_slot: int,
                  nodes_per_host: int) -> int:
    """A port out of SLURM_STEP_RESV_PORTS (the same range on every node of the step).

    Slurm keeps the range free of other steps on these nodes; the host slot keeps nodes that
    share one host apart, the generation keeps consecutive generations apart where the range
    allows.
    """
    lo, hi = resv_ports
    if not 0 < lo <= hi <= 65535:
        raise HpctError(f"SLURM_STEP_RESV_PORTS '{lo}-{hi}' is not a port range")
    count = hi - lo + 1
    return lo + (generation * nodes_per_host + host_slot) % count


def host_slots(addresses: Sequence[str]) -> list[int]:
    """Each member's index among the members that share its address (0 on real clusters)."""
    seen: dict[str, int] = {}
    slots = []
    for addr in addresses:
        slots.append(seen.get(addr, 0))
        seen[addr] = slots[-1] + 1
    return slots


def layout(members: Sequence[str], tasks_per_node: Sequence[int], node_name: str,
           local_rank: int) -> tuple[int, int, int]:
    """(rank, world_size, node_rank) with ranks laid out node by node in member order."""
    if not members:
        raise HpctError("members is empty: a generation needs at least one node")
    if len(set(members)) != len(members):
        dups = sorted({m for m in members if list(members).count(m) > 1})
        raise HpctError(f"members lists node(s) {dups} more than once")
    if len(tasks_per_node) != len(members):
        raise HpctError(f"tasks_per_node {list(tasks_per_node)} has {len(tasks_per_node)} "
                        f"entries for {len(members)} members")
    if any(t < 1 for t in tasks_per_node):
        raise HpctError(f"tasks_per_node {list(tasks_per_node)} must be at least 1 per node")
    try:
        node_rank = list(members).index(node_name)
    except ValueError:
        raise HpctError(f"node '{node_name}' is not a member of this generation: "
                        f"{list(members)}") from None
    if not 0 <= local_rank < tasks_per_node[node_rank]:
        raise HpctError(f"SLURM_LOCALID {local_rank} is outside the "
                        f"{tasks_per_node[node_rank]} tasks of node '{node_name}'")
    rank = sum(tasks_per_node[:node_rank]) + local_rank
    return rank, sum(tasks_per_node), node_rank


def resolve_host(name: str) -> str:
    """The IPv4 address of a node name (the cluster's resolver: /etc/hosts, DNS)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise HpctError(f"node name '{name}' does not resolve: {exc.strerror}") from None
    return infos[0][4][0]


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each local interface that has one."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)
            except OSError:
                continue  # interface without an IPv4 address
            out[name] = socket.inet_ntoa(res[20:24])
    return out


def ifname_for_address(addr: str) -> str | None:
    """The local interface holding `addr` (loopback addresses belong to `lo`)."""
    if ipaddress.ip_address(addr).is_loopback:
        return "lo"
    for name, a in interface_addresses().items():
        if a == addr:
            return name
    return None


def derive(env: "SlurmEnv", generation: int, members: Sequence[str] | None = None,
           tasks_per_node: int | None = None, port_base: int = DEFAULT_PORT_BASE,
           port_span: int = DEFAULT_PORT_SPAN, ifname: str | None = None, *,
           nodes_per_host: int | None = None,
           init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
           collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
           resolve: Callable[[str], str] | None = None,
           find_ifname: Callable[[str], str | None] | None = None,
           allowed_nodes: Sequence[str] | None = None) -> RendezvousInfo:
    """Derive this process's RendezvousInfo for `generation`.

    `members`/`tasks_per_node`: the controller's ordered member nodes and tasks on each; None
    means a plain `srun` spanning the nodes, whose SLURM_PROCID/NTASKS are already global.
    Ports come from SLURM_STEP_RESV_PORTS in that plain case (one step, one reserved range on
    all its nodes); with controller membership every node runs its own step with its own
    reservation, so ports are derived from (job, generation, host slot) instead.
    `resolve`/`find_ifname`: node name -> address, address -> local interface (default: the
    system's resolver and interfaces).
    `nodes_per_host`: ports set aside per (job, generation) on one host; None takes the most
    members found sharing one address (1 on a real cluster).
    """
    if generation < 0:
        raise HpctError(f"generation {generation!r} must not be negative")
    if init_timeout_s <= 0 or collective_timeout_s <= 0:
        raise HpctError(f"timeouts must be positive: init {init_timeout_s!r}, "
                        f"collective {collective_timeout_s!r}")
    if not env.node_name:
        raise HpctError("SLURMD_NODENAME is not set: derive runs inside a Slurm step")
    if env.localid is None:
        raise HpctError("SLURM_LOCALID is not set: derive runs inside a Slurm step (srun)")
    job_nodes = list(env.job_nodelist)
    use_resv_ports = members is None and env.step_resv_ports is not None

    if members is None:
        members = list(env.step_nodelist or job_nodes)
        per_node = _env_tasks_per_node(env, len(members))
        rank, world, node_rank = layout(members, per_node, env.node_name, env.localid)
        # Cyclic distributions (srun -m cyclic) number tasks across nodes: trust Slurm's own rank.
        if env.procid is not None:
            rank = env.procid
    else:
        members = list(members)
        if tasks_per_node is None:
            here = _env_tasks_per_node(env, 1)
            tasks_per_node = here[0]
        if tasks_per_node < 1:
            raise HpctError(f"tasks_per_node {tasks_per_node!r} must be at least 1")
        per_node = [tasks_per_node] * len(members)
        rank, world, node_rank = layout(members, per_node, env.node_name, env.localid)
    # A controller that borrows spares from the cluster pool runs them in a companion job, so
    # its members may lie outside this job's nodes: it then says which nodes it vouches for.
    allowed = job_nodes if allowed_nodes is None else list(allowed_nodes)
    strangers = [m for m in members if m not in allowed]
    if strangers:
        raise HpctError(f"member node(s) {strangers} are not in SLURM_JOB_NODELIST {job_nodes}")

    addresses = tuple((resolve or resolve_host)(m) for m in members)
    slots = host_slots(addresses)
    if nodes_per_host is None:
        nodes_per_host = max(slots) + 1
    elif max(slots) >= nodes_per_host:
        crowded = addresses[slots.index(max(slots))]
        raise HpctError(
            f"{max(slots) + 1} member nodes share address {crowded} but nodes_per_host is "
            f"{nodes_per_host}: raise it (HPCT_NODES_PER_HOST) or leave it unset")
    check_port_range(port_base, port_span, nodes_per_host)
    if use_resv_ports:
        ports = tuple(reserved_port(env.step_resv_ports, generation, slot, nodes_per_host)
                      for slot in slots)
    else:
        ports = tuple(derived_port(env.job_id, generation, slot, port_base=port_base,
                                   port_span=port_span, nodes_per_host=nodes_per_host)
                      for slot in slots)
    if ifname is None:
        ifname = (find_ifname or ifname_for_address)(addresses[node_rank])
        if ifname is None:
            raise HpctError(
                f"node '{env.node_name}' resolves to {addresses[node_rank]}, which no local "
                f"interface holds: set HPCT_SOCKET_IFNAME to the interface to use")
    return RendezvousInfo(
        job_id=env.job_id, generation=generation, rank=rank, world_size=world,
        local_rank=env.localid, local_world_size=per_node[node_rank], node_rank=node_rank,
        node_name=env.node_name, members=tuple(members), tasks_per_node=tuple(per_node),
        addresses=addresses, store_ports=ports, master_addr=addresses[0],
        master_port=ports[0], ifname=ifname, init_timeout_s=float(init_timeout_s),
        collective_timeout_s=float(collective_timeout_s))


def _env_tasks_per_node(env: "SlurmEnv", n_nodes: int) -> list[int]:
    per_node = list(env.tasks_per_node or [])
    if not per_node:
        if env.ntasks is None or env.ntasks % n_nodes:
            raise HpctError(f"SLURM_TASKS_PER_NODE is not set and SLURM_NTASKS {env.ntasks!r} "
                            f"does not split evenly over {n_nodes} node(s)")
        per_node = [env.ntasks // n_nodes] * n_nodes
    if len(per_node) != n_nodes:
        raise HpctError(f"SLURM_TASKS_PER_NODE {per_node} does not cover the step's "
                        f"{n_nodes} node(s)")
    return per_node
