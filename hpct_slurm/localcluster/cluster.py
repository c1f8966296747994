"""A real Slurm cluster on this one machine: munged + slurmctld + N slurmd.

netns mode (default): the controller lives in a network namespace holding a bridge; every node
has its own network namespace (eth0 on the bridge, its own address), its own hostname (UTS
namespace), its own /etc/hosts and /dev/shm (mount namespace). ports mode: all daemons on
loopback with distinct ports, still one mount namespace per node.

A node *is* its mount namespace: every process of the node (slurmd, slurmstepd, tasks) lives in
it, so a hard crash is "SIGKILL every process in that namespace", found by PID through /proc.
All state is under one root directory; `state.json` records the PIDs and namespace ids so a
later `down` (or a second `up`) finds exactly what is ours.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from .. import config as C
from ..errors import HpctError
from ..slurm.client import COMMANDS, SlurmClient, SlurmCommandError
from .layout import Hooks, Layout, default_ctl_host, hosts_text, slurm_conf

# The daemons this module starts itself; every client command goes through SlurmClient.
SLURM_BINARIES = ("slurmctld", "slurmd", "munged", *COMMANDS)
DEFAULT_ROOT = Path(C.read(None, C.LOCALCLUSTER_ROOT))
# Node shm is a per-node tmpfs, like a real node's /dev/shm.
NODE_SHM_SIZE = "2g"


@dataclass
class ClusterState:
    mode: str
    num_nodes: int
    ctl_host: str
    munged_pid: int = 0
    slurmctld_pid: int = 0
    slurmd_pids: dict[str, int] = field(default_factory=dict)
    # mount-namespace inode of each node's current boot. Only the current one: once a
    # namespace is gone the kernel reuses its inode number, possibly for another cluster's node.
    node_mntns: dict[str, int] = field(default_factory=dict)
    hooks: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> "ClusterState":
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise HpctError(f"cluster state file {path} is unreadable ({exc}); "
                            f"remove it after checking no cluster runs from that root") from exc

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env=dict(env) if env is not None else None)
    except FileNotFoundError as exc:
        raise HpctError(f"{argv[0]} is not installed: run the README setup command") from exc
    except subprocess.TimeoutExpired as exc:
        raise HpctError(f"{' '.join(argv)} timed out after {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise HpctError(f"{' '.join(argv)} failed ({proc.returncode}): "
                        f"{msg[-1] if msg else 'no output'}")
    return proc


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _ns_inode(pid: int | str, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def _pids_in_ns(kind: str, inodes: set[int]) -> list[int]:
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me and _ns_inode(entry, kind) in inodes:
            found.append(int(entry))
    return found


def _kill_pids(pids: Sequence[int], wait_s: float = 5.0) -> None:
    # Stopped first, all of them, then killed: a node's processes die together, as in a real
    # crash. Killed one by one, a process killed later could still act on an earlier one's
    # death (CI: a TP rank of the crashed node saw its partner die and took the STOP, 37 ms
    # after the fault, before its own SIGKILL came: the test process was preempted between
    # the kills on a loaded machine).
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.02)
    for pid in pids:  # reap those that are our children
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


class LocalCluster:
    """Bring up, inspect, fault and tear down a local Slurm cluster under `root`."""

    def __init__(self, root: str | os.PathLike = DEFAULT_ROOT, nodes: int = 4,
                 mode: str = "netns"):
        self.root = Path(root).absolute()
        state_path = self.root / "state.json"
        if state_path.exists():
            st = ClusterState.load(state_path)
            nodes, mode, ctl_host = st.num_nodes, st.mode, st.ctl_host
        else:
            ctl_host = default_ctl_host()
        self.layout = Layout(self.root, nodes, mode, ctl_host)

    # ---- views -------------------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        return self.layout.nodes

    @property
    def mode(self) -> str:
        return self.layout.mode

    @property
    def conf_path(self) -> Path:
        return self.layout.conf

    def node_addr(self, node: str) -> str:
        self._check_node(node)
        return self.layout.node_addr(node)

    def state(self) -> ClusterState | None:
        return ClusterState.load(self.layout.state_file) if self.layout.state_file.exists() \
            else None

    def env(self) -> dict[str, str]:
        """Environment for Slurm client commands against this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.layout.conf)
        for var in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID"):
            env.pop(var, None)  # a client run from inside a job must not inherit its job
        return env

    def command(self, argv: Sequence[str], node: str | None = None) -> list[str]:
        """argv wrapped to run in the controller's (or a node's) namespaces."""
        if node is not None:
            pid = self._slurmd_pid(node)
            kinds = ["-m", "-u"] + (["-n"] if self.mode == "netns" else [])
            return ["nsenter", "-t", str(pid), *kinds, "--", *argv]
        if self.mode == "netns":
            return ["nsenter", f"--net=/run/netns/{self.layout.netns(None)}", "--", *argv]
        return list(argv)

    def run(self, argv: Sequence[str], node: str | None = None, check: bool = False,
            timeout: float = 60, env: Mapping[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        full_env = self.env()
        full_env.update(env or {})
        return _run(self.command(argv, node), check=check, timeout=timeout, env=full_env)

    def popen(self, argv: Sequence[str], node: str | None = None,
              env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
        full_env = self.env()
        full_env.update(env or {})
        return subprocess.Popen(self.command(argv, node), env=full_env, **kwargs)

    def client(self) -> SlurmClient:
        """A SlurmClient bound to this cluster (SLURM_CONF and namespace); like `env()`, it
        drops the SLURM_JOB_ID of a job this runs inside."""
        return SlurmClient(env={"SLURM_CONF": str(self.layout.conf), "SLURM_JOB_ID": None,
                                "SLURM_JOBID": None, "SLURM_STEP_ID": None},
                           wrap=self.command([]))

    # ---- status ------------------------------------------------------------------------
    def node_states(self) -> dict[str, str]:
        """Slurm's state of every node, e.g. {'n1': 'idle', 'n2': 'down*'}."""
        return self.client().node_states()

    def status(self) -> dict:
        st = self.state()
        if st is None:
            return {"root": str(self.root), "up": False, "nodes": []}
        daemons = {"munged": _alive(st.munged_pid), "slurmctld": _alive(st.slurmctld_pid)}
        states = {}
        if daemons["munged"] and daemons["slurmctld"]:
            try:
                states = self.node_states()
            except HpctError:
                states = {}
        nodes = [{"name": n, "addr": self.layout.node_addr(n),
                  "slurmd_alive": _alive(st.slurmd_pids.get(n, 0)),
                  "state": states.get(n, "unknown")} for n in self.nodes]
        return {"root": str(self.root), "up": all(daemons.values()), "mode": st.mode,
                "cluster": self.layout.cluster_name, "slurm_conf": str(self.layout.conf),
                "daemons": daemons, "nodes": nodes}

    def wait_nodes(self, want: set[str] | None = None, timeout: float = 60,
                   nodes: Sequence[str] | None = None) -> dict[str, str]:
        """Wait until every node (or `nodes`) is in a state of `want` (default: idle)."""
        want = want or {"idle"}
        names = list(nodes or self.nodes)
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            try:
                states = self.node_states()
            except HpctError:
                states = {}
            if all(states.get(n) in want for n in names):
                return states
            if time.monotonic() > deadline:
                raise HpctError(f"nodes not {'/'.join(sorted(want))} after {timeout:.0f} s: "
                                f"{states or 'slurmctld not answering'}; "
                                f"see {self.root / 'log'}")
            time.sleep(0.2)

    # ---- up / down ---------------------------------------------------------------------
    def up(self, wait: bool = True) -> dict:
        for binary in SLURM_BINARIES:
            if shutil.which(binary) is None:
                raise HpctError(f"{binary} is not installed: run the README setup command "
                                f"(apt-get install slurmctld slurmd slurm-client munge)")
        if os.geteuid() != 0:
            raise HpctError("localcluster needs root (namespaces, munged, slurmd as root)")
        st = self.state()
        if st is not None:
            if self._healthy(st):
                if wait:
                    self.wait_nodes({"idle", "mixed", "allocated", "drained", "draining",
                                     "down", "down*", "idle*", "drained*"}, timeout=30)
                return self.status()
            self.down()  # dirty root: clear what state.json says is ours, then start fresh
        self._check_in_the_way()
        lay = self.layout
        for sub in ("etc", "log", "run", "spool/ctld", "munge/run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory others cannot traverse.
        for d in (self.root, self.root / "munge", self.root / "munge" / "run"):
            os.chmod(d, 0o755)
        st = ClusterState(mode=lay.mode, num_nodes=lay.num_nodes, ctl_host=lay.ctl_host)
        st.save(lay.state_file)
        self._write_configs(Hooks(**st.hooks))
        if lay.mode == "netns":
            self._make_network()
        st.munged_pid = self._start_munged()
        st.save(lay.state_file)
        st.slurmctld_pid = self._start_slurmctld()
        st.save(lay.state_file)
        for node in self.nodes:
            self._start_slurmd(st, node)
        if wait:
            self.wait_nodes(timeout=60)
        return self.status()

    def down(self) -> dict:
        """Stop everything of ours: processes by PID/namespace, namespaces, state file."""
        st = self.state()
        lay = self.layout
        killed = 0
        if st is not None:
            inodes = {self._node_inode(st, n) for n in self.nodes} - {None}
            net_inodes = set()
            if lay.mode == "netns":
                for node in [None, *self.nodes]:
                    path = Path("/run/netns") / lay.netns(node)
                    if path.exists():
                        net_inodes.add(path.stat().st_ino)
            victims = set(_pids_in_ns("mnt", inodes)) | set(_pids_in_ns("net", net_inodes))
            victims |= {p for p in [st.slurmctld_pid, st.munged_pid, *st.slurmd_pids.values()]
                        if _alive(p) and self._is_ours(p)}
            _kill_pids(sorted(victims))
            killed = len(victims)
        if lay.mode == "netns":
            for node in [*self.nodes, None]:
                name = lay.netns(node)
                if (Path("/run/netns") / name).exists():
                    _run(["ip", "netns", "del", name], check=False)
        if lay.state_file.exists():
            lay.state_file.unlink()
        return {"root": str(self.root), "down": True, "killed": killed}

    # ---- faults ------------------------------------------------------------------------
    def kill_node(self, node: str, pids: list[int] | None = None) -> list[int]:
        """Hard crash: SIGKILL the node's slurmd, slurmstepds and tasks, by PID. `pids`: those
        `node_pids` found beforehand (a scan of /proc, tens of ms on a loaded machine), for a
        caller that times the crash from its first SIGKILL."""
        self._require_state()
        self._check_node(node)
        if pids is None:
            pids = self.node_pids(node)
        _kill_pids(pids)
        return pids

    def revive_node(self, node: str, resume: bool = False) -> bool:
        """Boot the node again (fresh namespaces, new slurmd); optionally resume it in Slurm,
        which keeps a node it marked DOWN so until then. A node already running is only
        resumed (`resume`): True when a slurmd was booted."""
        st = self._require_state()
        self._check_node(node)
        booted = False
        if _alive(st.slurmd_pids.get(node, 0)):
            if not resume:
                raise HpctError(f"node {node} is running (slurmd pid {st.slurmd_pids[node]}); "
                                f"kill-node it first, or --resume it in Slurm")
        else:
            self._start_slurmd(st, node)
            booted = True
        if resume:
            with contextlib.suppress(SlurmCommandError):
                self.client().update_node(node, "RESUME")
        return booted

    def cut_link(self, node: str, up: bool = False) -> None:
        """Take a node's network link down (a partition), or back up."""
        self._require_state()
        self._check_node(node)
        if self.mode != "netns":
            raise HpctError("cut-link needs netns mode (ports mode shares one loopback)")
        _run(["ip", "-n", self.layout.netns(None), "link", "set",
              self.layout.bridge_port(node), "up" if up else "down"])

    def heal(self, cancel_jobs: bool = True, timeout: float = 60) -> None:
        """Undo every fault: cancel jobs, boot dead nodes, restore links, resume nodes."""
        st = self._require_state()
        slurm = self.client()
        if cancel_jobs:
            with contextlib.suppress(SlurmCommandError):
                slurm.cancel_user("root")
        for resv in ("hpct_spares", "hpct_check"):  # spare-pool tests' reservations
            with contextlib.suppress(SlurmCommandError):  # most often: there is none
                slurm.delete_reservation(resv)
        for node in self.nodes:
            if not _alive(st.slurmd_pids.get(node, 0)):
                self.revive_node(node)
            if self.mode == "netns":
                self.cut_link(node, up=True)
        states = self.node_states()
        sick = [n for n, s in states.items() if s.rstrip("*~#%$@^-") not in ("idle",)
                and not s.startswith(("alloc", "mix", "comp"))]
        if sick:
            with contextlib.suppress(SlurmCommandError):
                slurm.update_node(sick, "RESUME")
        self.wait_nodes(timeout=timeout)

    def node_pids(self, node: str) -> list[int]:
        st = self._require_state()
        inode = self._node_inode(st, node)
        return _pids_in_ns("mnt", {inode}) if inode is not None else []

    def set_hooks(self, hooks: Hooks) -> None:
        """Point slurm.conf at prolog/epilog/task-prolog scripts and reconfigure."""
        st = self._require_state()
        st.hooks = asdict(hooks)
        st.save(self.layout.state_file)
        self._write_configs(hooks)
        self.client().reconfigure()

    def set_plugstack(self, lines: Sequence[str]) -> None:
        """Replace plugstack.conf (srun/sbatch/slurmd read it at each job or step)."""
        self.layout.plugstack.write_text("".join(line + "\n" for line in lines))

    # ---- internals ---------------------------------------------------------------------
    def _node_inode(self, st: ClusterState, node: str) -> int | None:
        """The node's mount namespace, if it still exists: its slurmd is alive in it, or (netns
        mode) some process in the node's network namespace still holds it."""
        inode = st.node_mntns.get(node)
        pid = st.slurmd_pids.get(node, 0)
        if inode is None:
            return None
        if _alive(pid) and _ns_inode(pid, "mnt") == inode:
            return inode
        if self.mode == "netns":
            net = Path("/run/netns") / self.layout.netns(node)
            if net.exists():
                holders = set(_pids_in_ns("net", {net.stat().st_ino}))
                if any(_ns_inode(p, "mnt") == inode for p in holders):
                    return inode
        return None

    def _check_node(self, node: str) -> None:
        if node not in self.nodes:
            raise HpctError(f"node {node!r} is not in this cluster ({', '.join(self.nodes)})")

    def _require_state(self) -> ClusterState:
        st = self.state()
        if st is None:
            raise HpctError(f"no local cluster is up under {self.root}: run "
                            f"`hpct-slurm localcluster up`")
        return st

    def _slurmd_pid(self, node: str) -> int:
        st = self._require_state()
        self._check_node(node)
        pid = st.slurmd_pids.get(node, 0)
        if not _alive(pid):
            raise HpctError(f"node {node} is down (no slurmd): revive-node it first")
        return pid

    def _is_ours(self, pid: int) -> bool:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return any(str(self.root).encode() in part for part in cmd)

    def _healthy(self, st: ClusterState) -> bool:
        return (st.mode == self.mode and _alive(st.munged_pid) and _alive(st.slurmctld_pid)
                and all(_alive(st.slurmd_pids.get(n, 0)) for n in self.nodes))

    def _check_in_the_way(self) -> None:
        if self.mode == "netns":
            existing = [self.layout.netns(n) for n in [None, *self.nodes]
                        if (Path("/run/netns") / self.layout.netns(n)).exists()]
            for name in existing:  # no state file claims them: leftovers of a crashed `up`
                _run(["ip", "netns", "del", name], check=False)
        else:
            import socket

            for port in [self.layout.ctld_port, *map(self.layout.slurmd_port, self.nodes)]:
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    try:
                        s.bind(("127.0.0.1", port))
                    except OSError:
                        raise HpctError(f"port {port} on 127.0.0.1 is in use; ports mode "
                                        f"needs {self.layout.ctld_port}.."
                                        f"{self.layout.ctld_port + len(self.nodes)}: stop "
                                        f"what holds it or use another --root") from None

    def _write_configs(self, hooks: Hooks) -> None:
        lay = self.layout
        lay.conf.write_text(slurm_conf(lay, hooks))
        lay.hosts_file.write_text(hosts_text(lay))
        if not lay.plugstack.exists():
            lay.plugstack.write_text("")

    def _make_network(self) -> None:
        lay = self.layout
        ctl = lay.netns(None)
        _run(["ip", "netns", "add", ctl])
        _run(["ip", "-n", ctl, "link", "set", "lo", "up"])
        _run(["ip", "-n", ctl, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", ctl, "addr", "add", f"{lay.ctl_addr}/24", "dev", "br0"])
        _run(["ip", "-n", ctl, "link", "set", "br0", "up"])
        for node in self.nodes:
            ns = lay.netns(node)
            port = lay.bridge_port(node)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ctl, "link", "add", port, "type", "veth", "peer", "name",
                  "eth0", "netns", ns])
            _run(["ip", "-n", ctl, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{lay.node_addr(node)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _start_munged(self) -> int:
        mdir = self.root / "munge"
        key = mdir / "munge.key"
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(1024))
        pidfile = mdir / "munged.pid"
        _run(["munged", "--force", f"--key-file={key}", f"--socket={self.layout.munge_socket}",
              f"--pid-file={pidfile}", f"--seed-file={mdir / 'munged.seed'}",
              f"--log-file={self.layout.log('munged')}"])
        return self._wait_pidfile(pidfile, "munged")

    def _start_slurmctld(self) -> int:
        lay = self.layout
        argv = ["slurmctld", "-D", "-i", "-f", str(lay.conf)]
        if lay.mode == "netns":
            argv = ["nsenter", f"--net=/run/netns/{lay.netns(None)}", "--", *argv]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                stdout=open(lay.log("slurmctld.out"), "ab"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise HpctError(f"slurmctld exited ({proc.returncode}) at start; see "
                                f"{lay.log('slurmctld')}")
            if self.client().ping(timeout=10):
                return proc.pid
            time.sleep(0.1)
        raise HpctError(f"slurmctld did not answer ping in 20 s; see {lay.log('slurmctld')}")

    def _start_slurmd(self, st: ClusterState, node: str) -> None:
        lay = self.layout
        # Node boot in its own UTS + mount namespace: hostname, /etc/hosts, private /dev/shm.
        # Values reach sh as positional parameters, never spliced into the script text.
        boot = ('hostname "$1" && mount --make-rprivate / && mount --bind "$2" /etc/hosts && '
                'mount -t tmpfs -o "size=$4,mode=1777" tmpfs /dev/shm && '
                'exec slurmd -D -f "$3" -N "$5"')
        # ports mode keeps the machine's hostname: there the nodes differ only by name/port.
        hostname = node if lay.mode == "netns" else lay.ctl_host
        argv = ["unshare", "--uts", "--mount", "--", "sh", "-c", boot, "hpct-node-boot",
                hostname, str(lay.hosts_file), str(lay.conf), NODE_SHM_SIZE, node]
        if lay.mode == "netns":
            argv = ["nsenter", f"--net=/run/netns/{lay.netns(node)}", "--", *argv]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                stdout=open(lay.log(f"slurmd-{node}.out"), "ab"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        own = _ns_inode("self", "mnt")
        deadline = time.monotonic() + 10
        inode = None
        # Wait until the boot script has entered its new mount namespace; before that the
        # pid still shares ours, and recording ours would make kill-node kill everything.
        while time.monotonic() < deadline:
            inode = _ns_inode(proc.pid, "mnt")
            if proc.poll() is not None:
                raise HpctError(f"slurmd for {node} exited ({proc.returncode}) at boot; see "
                                f"{lay.log(f'slurmd-{node}.out')}")
            if inode is not None and inode != own and self._is_slurmd(proc.pid):
                break
            time.sleep(0.01)
        else:
            raise HpctError(f"slurmd for {node} did not start within 10 s")
        st.slurmd_pids[node] = proc.pid
        st.node_mntns[node] = inode
        st.save(lay.state_file)

    @staticmethod
    def _is_slurmd(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip() == "slurmd"
        except OSError:
            return False

    @staticmethod
    def _wait_pidfile(path: Path, what: str, timeout: float = 10) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid = int(path.read_text().strip())
                if _alive(pid):
                    return pid
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise HpctError(f"{what} did not start within {timeout:.0f} s (no pid in {path})")
