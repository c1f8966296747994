"""Batch-script driver of a peer in `hpct-slurm bench peers`: launches torchft or NVRx on the
job's nodes the way each peer's own Slurm deployment does, on the batch host (the first node,
never faulted: it holds each peer's single point of failure).

  torchft  the Lighthouse (README flags) on the batch host; one job step per replica group
           (one node, one process each); a group whose step ends or whose node's slurmd stops
           answering is relaunched onto a spare node (what torchft's Slurm example does with
           torchx's monitor loop, which is not installed here);
  nvrx     a standalone c10d TCPStore on the batch host as the rendezvous endpoint (so that no
           training node hosts it); one job step of `ft_launcher` over every node, active and
           spare (`--nnodes=A:A`: the spare waits in the rendezvous and is promoted at the next
           round); a failure restarts every rank in the job (in-job restart).

The driver's own record is `driver.jsonl` in the run dir: {"t", "event", ...} lines
(`peer.launch`, `peer.lost`, `peer.relaunch`, `peer.done`). It exits once every rank wrote its
result. Usage (as the batch script):
    python -m hpct_slurm.bench.peers_driver --system torchft|nvrx --run-dir D \
        [--heartbeat-ms MS] [--active A] -- SCRIPT_ARGS...
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..slurm.client import SlurmClient, srun_argv
from ..slurm.env import SlurmEnv

LIGHTHOUSE_PORT, STORE_PORT, GROUP_PORT = 29510, 29700, 29600
BATCH_SCRIPT = "#!/bin/bash\n#SBATCH --exclusive\n#SBATCH --no-kill\n" \
               'exec "$HPCT_PYTHON" -m hpct_slurm.bench.peers_driver "$@"\n'


def batch_script(run_dir: Path) -> Path:
    """The sbatch script (constant text: everything comes in as its arguments)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "peers.sbatch"
    path.write_text(BATCH_SCRIPT)
    return path


class Record:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, event: str, **fields) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")


def _reachable(addr: str, port: int = 6818) -> bool:
    """Whether the node's slurmd accepts a TCP connection within a second (the check the
    hpct-slurm controller makes before fencing: controller/fencing.py)."""
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


def _stepped(run_dir: Path) -> bool:
    """Whether any rank logged a step yet."""
    d = run_dir / "events"
    return d.exists() and any(f.stat().st_size for f in d.glob("*.jsonl"))


def _done(run_dir: Path, rank: int) -> bool:
    return (run_dir / "results" / f"rank{rank}.json").exists()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def run_torchft(args, run_dir: Path, nodes: list[str], record: Record) -> int:
    slurm = SlurmClient()
    bindir = Path(sys.executable).parent
    host = socket.gethostname()
    active, spares = nodes[:args.active], nodes[args.active:]
    log = open(run_dir / "lighthouse.log", "ab")
    lighthouse = subprocess.Popen(
        [str(bindir / "torchft_lighthouse"), "--min_replicas", "1", "--quorum_tick_ms", "100",
         "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", str(args.heartbeat_ms),
         "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}"], stdout=log, stderr=subprocess.STDOUT)
    record("peer.lighthouse", pid=lighthouse.pid, heartbeat_timeout_ms=args.heartbeat_ms)
    steps: dict[int, subprocess.Popen] = {}
    where: dict[int, str] = {}
    addrs = {n: slurm.show_node(n).addr or n for n in nodes}

    def launch(group: int, node: str) -> None:
        env = {**os.environ, "REPLICA_GROUP_ID": str(group),
               "NUM_REPLICA_GROUPS": str(args.active),
               "TORCHFT_LIGHTHOUSE": f"http://{host}:{LIGHTHOUSE_PORT}"}
        out = open(run_dir / f"group{group}-{node}.log", "ab")
        # torchrun hosts the group's store at MASTER_ADDR:MASTER_PORT (the Manager connects
        # to it), as in torchft's examples; --rdzv_backend=static: one process, no rendezvous
        argv = srun_argv(node, [str(bindir / "torchrun"), "--nnodes=1", "--nproc_per_node=1",
                                "--rdzv_backend=static", f"--master_addr={node}",
                                f"--master_port={GROUP_PORT}", "-m",
                                "hpct_slurm.examples.peers.torchft_ddp", *args.script_args],
                         extra_opts=["--overlap", "-u", "--kill-on-bad-exit=0"])
        steps[group] = subprocess.Popen(slurm.command(argv), env=slurm.environ(env),
                                        stdout=out, stderr=subprocess.STDOUT)
        where[group] = node
        record("peer.launch", group=group, node=node)

    for g, node in enumerate(active):
        launch(g, node)
    rc = 1
    try:
        last_ping = 0.0
        while True:
            if all(_done(run_dir, g) for g in range(args.active)):
                rc = 0
                break
            ping = time.monotonic() - last_ping > 0.3
            if ping:
                last_ping = time.monotonic()
            for g in range(args.active):
                if _done(run_dir, g):
                    continue
                node = where[g]
                exited = steps[g].poll() is not None
                lost = exited or (ping and not _reachable(addrs[node]))
                if not lost:
                    continue
                record("peer.lost", group=g, node=node, step_exited=exited)
                if not spares:
                    record("peer.no_spare", group=g)
                    return 1
                launch(g, spares.pop(0))
                record("peer.relaunch", group=g, node=where[g], lost=node)
            time.sleep(0.1)
    finally:
        record("peer.done", rc=rc)
        _stop([*steps.values(), lighthouse])
    return rc


def run_nvrx(args, run_dir: Path, nodes: list[str], record: Record) -> int:
    from torch.distributed import TCPStore

    slurm = SlurmClient()
    bindir = Path(sys.executable).parent
    host = socket.gethostname()
    store = TCPStore("0.0.0.0", STORE_PORT, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(hours=1))
    record("peer.store", host=host, port=STORE_PORT)
    launcher = [str(bindir / "ft_launcher"), f"--nnodes={args.active}:{args.active}",
                "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={host}:{STORE_PORT}", f"--rdzv-id=nvrx-{os.getpid()}",
                "--monitor-interval=0.1", "--ft-initial-rank-heartbeat-timeout=60",
                "--ft-rank-heartbeat-timeout=30",
                "-m", "hpct_slurm.examples.peers.nvrx_ddp", *args.script_args,
                "--ckpt-dir", str(run_dir / "ckpt")]
    active, spares = nodes[:args.active], nodes[args.active:]
    procs: list[subprocess.Popen] = []

    def launch(node: str, role: str) -> None:
        # one job step per node, as with torchft: a node's death ends only its own step
        argv = srun_argv(node, launcher, extra_opts=["--overlap", "-u", "--kill-on-bad-exit=0"])
        out = open(run_dir / f"ft_launcher-{node}.log", "ab")
        procs.append(subprocess.Popen(slurm.command(argv), env=slurm.environ(), stdout=out,
                                      stderr=subprocess.STDOUT))
        record("peer.launch", node=node, role=role)

    for node in active:
        launch(node, "active")
    # The spare's launcher joins once the active ones formed their group (the first step is
    # logged): it then waits in the rendezvous as a standby and is promoted at the next round.
    # Started together, any of the five could have been left over as the standby.
    deadline = time.monotonic() + 300
    while not _stepped(run_dir) and time.monotonic() < deadline \
            and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    for node in spares:
        launch(node, "spare")
    rc = 1
    try:
        while True:
            if all(_done(run_dir, r) for r in range(args.active)):
                rc = 0
                break
            if all(p.poll() is not None for p in procs):
                record("peer.step_exit", codes=[p.returncode for p in procs])
                break
            time.sleep(0.2)
        if rc == 0:  # let the launchers end on their own, briefly
            deadline = time.monotonic() + 15
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        record("peer.done", rc=rc)
        _stop(procs)
        del store
    return rc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=["torchft", "nvrx"], required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--active", type=int, default=4)
    ap.add_argument("--heartbeat-ms", type=int, default=1000)
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.script_args[:1] == ["--"]:
        args.script_args = args.script_args[1:]
    run_dir = Path(args.run_dir)
    nodes = list(SlurmEnv.from_environ().job_nodelist)
    record = Record(run_dir / "driver.jsonl")
    record("peer.start", system=args.system, nodes=nodes)
    if args.system == "torchft":
        return run_torchft(args, run_dir, nodes, record)
    return run_nvrx(args, run_dir, nodes, record)


if __name__ == "__main__":
    sys.exit(main())
