"""The fence (HPCT_FENCE=nft): a packet filter for the traffic no secret protects.

Our own messages (controller, relay, transfer, store) carry MACs with the job's secret; gloo's
TCP listener and pairs, NCCL's bootstrap and torch's TCPStore do not, and any process that
reaches gloo's port can fill a rank's descriptor table or claim a pair at a formation (issue
45). The Prolog installs, in the node's network namespace, rules that admit new TCP
connections to the node's ephemeral ports and the rendezvous port range (HPCT_PORT_BASE and
HPCT_PORT_SPAN as the hooks see them: a TCPStore listens there) only

* from the allocation's node addresses (SLURM_JOB_NODELIST, resolved as the ranks resolve
  them), slurmctld's (srun's ephemeral ports take its messages) and HPCT_FENCE_ALLOW;
* on loopback, only from root's and the job user's sockets (`meta skuid` on output: a local
  connection's SYN leaves through `lo` with the connecting socket's owner), and to a listener
  of the job's user only from that user and root: the SYN marks its conntrack entry with the
  connecting user (`ct mark`; root's stay 0), and the listener's SYN-ACK, which leaves from
  the listening socket and so carries its owner, passes only to a connection of its own user
  or root's. Another job's user on the node gets its SYN-ACK reset: no answer, a timeout.
  Root's listeners answer every connection the SYN's check admitted.

Why ports and not the socket's owner: gloo binds port 0, so its ports are only known to be in
the ephemeral range (net.ipv4.ip_local_port_range, read per namespace); the receiving socket's
owner cannot be matched on input (nftables' `socket` expression has no uid, and `socket
cgroupv2` needs the job in a cgroup v2 of its own, which proctrack/linuxproc and the local
cluster's hybrid hierarchy do not give), so the port range is the handle. Fixed-port services
(sshd, slurmd) and established connections (conntrack's `established, related`: a packet a site
rule left `untracked` meets the rules) are untouched; a service that listens on an
ephemeral port for hosts outside the allocation (NFS callbacks) needs HPCT_FENCE_ALLOW.

One table, `inet hpct_fence`, holds a pair of chains per job (`job_<id>_in`, `job_<id>_out`:
what that job admits) and three chains (input, output, and `answer` for listeners' SYN-ACKs)
that jump to every job's chains and reject what none admitted, rebuilt under a lock by each
Prolog and Epilog in one atomic `nft -f` script. So jobs sharing a node admit each other's
peers (the union: an address has no owner), while on the node each user reaches only its own
listeners and root's; an Epilog removes exactly its job's chains, and the last one removes
the table. The conntrack mark of loopback connections to
fenced ports is the fence's: a site rule must not rely on it there. Nothing here fails a
Prolog: a missing `nft`, a node that does not resolve, a refused script: the job runs unfenced
and the hooks log says why (`hook_fence_skipped`).
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from .. import config as C
from ..errors import HpctError, describe
from ..events import Ev, EventLog
from .context import JobContext

TABLE = "hpct_fence"
LOCK = Path("/run/hpct-fence.lock")
PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_JOB_CHAIN = re.compile(r"job_([0-9]+)_in")
# `SlurmctldHost[0] = name(addr)` or `= name` in `scontrol show config`
_CTLD = re.compile(r"^SlurmctldHost\[\d+\]\s*=\s*([^\s(]+)(?:\(([^)]*)\))?", re.M)

Run = Callable[[Sequence[str], str], subprocess.CompletedProcess]
# A listener's SYN-ACK: the first packet of a connection where its receiving socket's owner
# is known (it goes out from that socket)
_ANSWER = "tcp flags & (syn | ack) == syn | ack"


@dataclass(frozen=True)
class FenceConfig:
    mode: str = "off"
    allow: str = ""  # HPCT_FENCE_ALLOW as given: parsed in the Prolog, where an error is logged
    rendezvous: tuple[int, int] = (20000, 28191)  # the store's ports (rendezvous/derive.py)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "FenceConfig":
        base = C.read(environ, C.PORT_BASE)
        return cls(mode=C.read(environ, C.FENCE), allow=C.read(environ, C.FENCE_ALLOW) or "",
                   rendezvous=(base, min(65535, base + C.read(environ, C.PORT_SPAN) - 1)))


def parse_allow(text: str) -> tuple[str, ...]:
    """HPCT_FENCE_ALLOW's networks, each checked (an IPv4 address or network)."""
    nets = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            nets.append(str(ipaddress.IPv4Network(item, strict=False)))
        except ValueError:
            raise HpctError(f"{C.FENCE_ALLOW} entry {item!r} is not an IPv4 address or "
                            f"network") from None
    return tuple(nets)


def controller_hosts(show_config: str) -> list[str]:
    """slurmctld's hosts from `scontrol show config`: the address where one is given."""
    return [addr or name for name, addr in _CTLD.findall(show_config)]


def port_range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split())
    if not 0 < lo <= hi <= 65535:
        raise HpctError(f"ip_local_port_range {text.strip()!r} is not a port range")
    return lo, hi


def merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Port ranges with overlapping and adjacent ones joined (nft refuses overlapping
    intervals in one set)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return out


def port_text(ranges: Sequence[tuple[int, int]]) -> list[str]:
    return [f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in ranges]


def script(jobs: Mapping[int, tuple[int, Sequence[str]] | None],
           ports: Sequence[tuple[int, int]], keep: Iterable[int]) -> str:
    """The `nft -f` script that leaves the table as it must be: `jobs` maps a job to (uid,
    admitted networks) to install its chains now, or None to delete them; `keep` are the
    jobs whose chains stay as they are. No job left: the table goes."""
    t = f"inet {TABLE}"
    lines = [f"add table {t}",
             f"add chain {t} input {{ type filter hook input priority filter - 1; "
             f"policy accept; }}",
             f"add chain {t} output {{ type filter hook output priority filter - 1; "
             f"policy accept; }}",
             f"add chain {t} answer",
             f"flush chain {t} input", f"flush chain {t} output", f"flush chain {t} answer"]
    for job, spec in sorted(jobs.items()):
        for side in ("in", "out"):
            lines += [f"add chain {t} job_{job}_{side}", f"flush chain {t} job_{job}_{side}"]
        if spec is None:
            lines += [f"delete chain {t} job_{job}_in", f"delete chain {t} job_{job}_out"]
            continue
        uid, nets = spec
        lines.append(f"add rule {t} job_{job}_in ip saddr {{ {', '.join(nets)} }} accept")
        # On loopback: the job's user's connections, marked with that user (`ct mark`) for
        # its listeners' answers, which go only to connections so marked; root's unmarked.
        out = [f"{_ANSWER} ct mark != {uid} return", f"meta skuid {uid} ct mark set {uid} accept"]
        out += [] if uid == 0 else ["meta skuid 0 accept"]
        lines += [f"add rule {t} job_{job}_out {rule}" for rule in out]
    live = sorted(set(keep) | {j for j, spec in jobs.items() if spec is not None})
    if not live:
        return "\n".join(lines[:1] + [f"delete table {t}"]) + "\n"
    fenced = f"{{ {', '.join(port_text(merged(ports)))} }}"
    # not `!= new`: a site's `notrack` leaves a stranger's SYN `untracked`
    tracked = "ct state { established, related } accept"
    # What the fence leaves alone, then each job's admissions, then the refusal.
    inbound = ["iif lo accept", "meta l4proto != tcp accept", tracked,
               f"tcp dport != {fenced} accept"]
    outbound = ["oif != lo accept", "meta l4proto != tcp accept",
                f"{_ANSWER} tcp sport {fenced} jump answer", tracked,
                f"tcp dport != {fenced} accept"]
    # The listener's side of a local connection, in its SYN-ACK: `meta skuid` is the
    # listener's owner there, which nothing on input can match.
    answer = [
        # no conntrack (a site's notrack), so no connecting owner: its SYN's check stands
        "ct state untracked accept",
        "meta skuid 0 accept",  # root's listener
        "ct mark 0 accept"]     # root's connection
    for chain, side, head in (("input", "in", inbound), ("output", "out", outbound),
                              ("answer", "out", answer)):
        lines += [f"add rule {t} {chain} {rule}" for rule in head]
        lines += [f"add rule {t} {chain} jump job_{j}_{side}" for j in live]
        lines.append(f"add rule {t} {chain} counter reject with tcp reset")
    return "\n".join(lines) + "\n"


def _nft(argv: Sequence[str], stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=20)


class Fence:
    """The node's fence table, through `nft` (`run` is the boundary a test may replace)."""

    def __init__(self, nft: str, run: Run = _nft, lock: Path = LOCK,
                 ports_file: Path = PORT_RANGE, also: Sequence[tuple[int, int]] = ()):
        self.nft, self.run, self.lock, self.ports_file = nft, run, lock, ports_file
        self.also = list(also)  # fenced besides the ephemeral range: the rendezvous range

    def ports(self) -> list[tuple[int, int]]:
        """The fenced ports: the namespace's ephemeral range and `also`."""
        return merged([port_range(self.ports_file.read_text()), *self.also])

    def jobs(self) -> set[int]:
        """The jobs whose chains are in the table now (none when there is no table)."""
        proc = self.run([self.nft, "-j", "list", "table", "inet", TABLE], "")
        if proc.returncode != 0:
            return set()  # no table
        items = json.loads(proc.stdout).get("nftables", [])
        names = [i["chain"]["name"] for i in items if "chain" in i]
        return {int(m.group(1)) for n in names if (m := _JOB_CHAIN.fullmatch(n))}

    def apply(self, jobs: Mapping[int, tuple[int, Sequence[str]] | None]) -> set[int]:
        """Install or delete `jobs`' chains; the jobs fenced afterwards."""
        with open(self.lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # Prologs and Epilogs of jobs on this node
            keep = self.jobs() - set(jobs)
            text = script(jobs, self.ports(), keep)
            proc = self.run([self.nft, "-f", "-"], text)
            if proc.returncode != 0:
                raise HpctError(f"nft refused the fence: {proc.stderr.strip()[:300]}")
            return keep | {j for j, spec in jobs.items() if spec is not None}


def admitted(nodes: Iterable[str], ctld: Iterable[str], allow: Sequence[str],
             resolve: Callable[[str], str]) -> list[str]:
    """The networks a job's fence admits: its nodes' and slurmctld's addresses, as resolved
    here (raises naming a name that does not resolve), and the site's HPCT_FENCE_ALLOW."""
    addrs = {resolve(n) for n in [*nodes, *ctld]}
    return sorted({*(f"{a}/32" for a in addrs), *allow})


def install(job: JobContext, nodelist: str, cfg: FenceConfig, log: EventLog,
            ctld: Callable[[], list[str]], resolve: Callable[[str], str],
            fence: Fence | None = None,
            active: Callable[[], set[int] | None] = lambda: None) -> bool:
    """The Prolog's part: fence the job; True when its rules are in. The chains of jobs
    Slurm no longer runs (`active`; None or an error: no sweep) go in the same script: a
    node that crashed never ran their Epilog, and its namespace keeps its rules. Never
    raises."""
    if cfg.mode == "off":
        return False
    try:
        from ..slurm.hostlist import expand

        fence = fence or Fence(_which_nft(), also=[cfg.rendezvous])
        nets = admitted(expand(nodelist), ctld(), parse_allow(cfg.allow), resolve)
        ports = fence.ports()
        stale = _stale(fence.jobs() - {job.job_id}, active)
        fenced = fence.apply({job.job_id: (job.uid, nets), **{j: None for j in stale}})
    except Exception as exc:  # noqa: BLE001 - a fence it cannot make never fails the Prolog
        log.emit(Ev.HOOK_FENCE_SKIPPED, node=job.node, job_id=job.job_id, error=describe(exc))
        return False
    log.emit(Ev.HOOK_FENCE_INSTALLED, node=job.node, job_id=job.job_id, table=f"inet {TABLE}",
             chains=[f"job_{job.job_id}_in", f"job_{job.job_id}_out"], admitted=nets,
             uids=sorted({0, job.uid}), ports=port_text(ports), jobs=sorted(fenced),
             swept=sorted(stale))
    return True


def _stale(present: set[int], active: Callable[[], set[int] | None]) -> set[int]:
    if not present:
        return set()
    try:
        running = active()
    except Exception:  # noqa: BLE001 - Slurm cannot say: keep them (a job may still run)
        return set()
    return set() if running is None else present - running


def remove(job: JobContext, cfg: FenceConfig, log: EventLog,
           fence: Fence | None = None) -> bool:
    """The Epilog's part: remove exactly this job's chains (and the table with the last
    job's). Also when the fence is off now: a Prolog may have installed it before the site
    turned it off. True when the job was fenced. Never raises."""
    nft = shutil.which("nft", path=_PATH)
    if fence is None and nft is None:
        return False  # no nft: nothing can have been installed
    try:
        fence = fence or Fence(nft or "nft", also=[cfg.rendezvous])
        found = job.job_id in fence.jobs()
        left = fence.apply({job.job_id: None}) if found else fence.jobs()
    except Exception as exc:  # noqa: BLE001 - an Epilog never fails the node
        log.emit(Ev.HOOK_FENCE_SKIPPED, node=job.node, job_id=job.job_id, error=describe(exc))
        return False
    if found or cfg.mode != "off":
        log.emit(Ev.HOOK_FENCE_REMOVED, node=job.node, job_id=job.job_id, found=found,
                 jobs=sorted(left))
    return found


# slurmd runs hooks with an almost empty PATH: nft lives in sbin
_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"


def _which_nft() -> str:
    nft = shutil.which("nft", path=_PATH)
    if nft is None:
        raise HpctError("HPCT_FENCE=nft but nft is not installed (apt-get install nftables): "
                        "the job runs unfenced")
    return nft
