"""Batch-script driver of a peer in `hpct-slurm bench peers`: launches torchft or NVRx on the
job's nodes the way each peer's own Slurm deployment does, on the batch host (the first node,
never faulted: it holds each peer's single point of failure). Each mode (issue 44):

  torchft           the Lighthouse (README flags) on the batch host; one job step per replica
                    group (one node, one process each), on every node: 4 groups take part and
                    the fifth is a live spare (WorldSizeMode.FIXED_WITH_SPARES); a lost group
                    is not replaced;
  torchft-relaunch  the same with 4 groups (WorldSizeMode.DYNAMIC); a group whose step ends or
                    whose node's slurmd stops answering is relaunched onto the spare node (what
                    torchft's Slurm example does with torchx's monitor loop, not installed here);
  nvrx              in-process restart: one job step per node running the script under
                    `inprocess.Wrapper`, 5 ranks of which 4 are active and one a reserve;
  nvrx-injob        a standalone c10d TCPStore on the batch host as the rendezvous endpoint; one
                    job step of `ft_launcher` per node, active and spare (`--nnodes=A:A`: the
                    spare waits in the rendezvous); a failure restarts every rank (in-job).

The driver's own record is `driver.jsonl` in the run dir: {"t", "event", ...} lines
(`peer.launch`, `peer.lost`, `peer.relaunch`, `peer.done`). It exits once every rank wrote its
result. Usage (as the batch script):
    python -m hpct_slurm.bench.peers_driver --system MODE --run-dir D \
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

LIGHTHOUSE_PORT, STORE_PORT, GROUP_PORT, INPROCESS_PORT = 29510, 29700, 29600, 29800
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


def _srun(slurm: SlurmClient, node: str, argv: list[str], env: dict[str, str], out: Path):
    """`argv` as its own job step on `node`: a node's death ends only its own step."""
    cmd = srun_argv(node, argv, extra_opts=["--overlap", "-u", "--kill-on-bad-exit=0"])
    return subprocess.Popen(slurm.command(cmd), env=slurm.environ(env),
                            stdout=open(out, "ab"), stderr=subprocess.STDOUT)


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
    """torchft: a live spare group (`--spares 1`, a group on every node) or, with
    args.system == "torchft-relaunch", 4 groups and the lost one relaunched onto the spare."""
    slurm = SlurmClient()
    bindir = Path(sys.executable).parent
    host = socket.gethostname()
    spare_mode = args.system == "torchft"
    groups = len(nodes) if spare_mode else args.active
    log = open(run_dir / "lighthouse.log", "ab")
    lighthouse = subprocess.Popen(
        [str(bindir / "torchft_lighthouse"), "--min_replicas", "1", "--quorum_tick_ms", "100",
         "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", str(args.heartbeat_ms),
         "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}"], stdout=log, stderr=subprocess.STDOUT)
    record("peer.lighthouse", pid=lighthouse.pid, heartbeat_timeout_ms=args.heartbeat_ms)
    steps: dict[int, subprocess.Popen] = {}
    where: dict[int, str] = {}
    lost: set[int] = set()
    addrs = {n: slurm.show_node(n).addr or n for n in nodes}
    spares = [] if spare_mode else nodes[groups:]

    def launch(group: int, node: str) -> None:
        env = {**os.environ, "REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": str(groups),
               "TORCHFT_LIGHTHOUSE": f"http://{host}:{LIGHTHOUSE_PORT}"}
        # torchrun hosts the group's store at MASTER_ADDR:MASTER_PORT (the Manager connects
        # to it), as in torchft's examples; --rdzv_backend=static: one process, no rendezvous
        steps[group] = _srun(slurm, node, [
            str(bindir / "torchrun"), "--nnodes=1", "--nproc_per_node=1",
            "--rdzv_backend=static", f"--master_addr={node}", f"--master_port={GROUP_PORT}",
            "-m", "hpct_slurm.examples.peers.torchft_ddp", *args.script_args,
            "--spares", str(groups - args.active)], env, run_dir / f"group{group}-{node}.log")
        where[group] = node
        record("peer.launch", group=group, node=node)

    for g, node in enumerate(nodes[:groups]):
        launch(g, node)
    rc = 1
    try:
        last_ping = 0.0
        while True:
            alive = [g for g in range(groups) if g not in lost]
            if all(_done(run_dir, g) for g in alive) and len(alive) >= args.active:
                rc = 0
                break
            ping = time.monotonic() - last_ping > 0.3
            if ping:
                last_ping = time.monotonic()
            for g in alive:
                if _done(run_dir, g):
                    continue
                node = where[g]
                exited = steps[g].poll() is not None
                if not (exited or (ping and not _reachable(addrs[node]))):
                    continue
                record("peer.lost", group=g, node=node, step_exited=exited)
                if spare_mode:  # the live spare took its place: nothing to launch
                    lost.add(g)
                    continue
                if not spares:
                    record("peer.no_spare", group=g)
                    return 1
                launch(g, spares.pop(0))
                record("peer.relaunch", group=g, node=where[g], lost=node)
            if len(lost) > groups - args.active:
                record("peer.no_spare", lost=sorted(lost))
                return 1
            time.sleep(0.1)
    finally:
        record("peer.done", rc=rc)
        _stop([*steps.values(), lighthouse])
    return rc


def run_nvrx_inprocess(args, run_dir: Path, nodes: list[str], record: Record) -> int:
    """NVRx in-process restart: one rank per node (the last a reserve), each its own job step;
    rank 0 (on the batch host) hosts the Wrapper's store and the training's."""
    slurm = SlurmClient()
    host = socket.gethostname()
    procs = []
    for rank, node in enumerate(nodes):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(nodes)),
               "LOCAL_RANK": "0", "MASTER_ADDR": host, "MASTER_PORT": str(INPROCESS_PORT)}
        procs.append(_srun(slurm, node, [
            sys.executable, "-m", "hpct_slurm.examples.peers.nvrx_inprocess",
            *args.script_args, "--ckpt-dir", str(run_dir / "ckpt")], env,
            run_dir / f"rank{rank}-{node}.log"))
        record("peer.launch", node=node, rank=rank,
               role="active" if rank < args.active else "reserve")
    return _wait_results(args, run_dir, procs, record)


def _wait_results(args, run_dir: Path, procs: list, record: Record) -> int:
    """Until ranks 0..active-1 wrote their results (0) or every step ended (1); then the
    steps get a short while to end on their own."""
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
        if rc == 0:
            deadline = time.monotonic() + 15
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
            record("peer.step_exit", codes=[p.poll() for p in procs])
    finally:
        record("peer.done", rc=rc)
        _stop(procs)
    return rc


def run_nvrx_injob(args, run_dir: Path, nodes: list[str], record: Record) -> int:
    from torch.distributed import TCPStore

    slurm = SlurmClient()
    host = socket.gethostname()
    store = TCPStore("0.0.0.0", STORE_PORT, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(hours=1))
    record("peer.store", host=host, port=STORE_PORT)
    # ft_launcher's console script is `nvidia_resiliency_ext.fault_tolerance.launcher:main`,
    # run through this interpreter (so it need not be on PATH)
    launcher = [sys.executable, "-c", "import sys; from nvidia_resiliency_ext.fault_tolerance."
                "launcher import main; sys.exit(main())",
                f"--nnodes={args.active}:{args.active}",
                "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={host}:{STORE_PORT}", f"--rdzv-id=nvrx-{os.getpid()}",
                "--monitor-interval=0.1", "--ft-initial-rank-heartbeat-timeout=60",
                "--ft-rank-heartbeat-timeout=30",
                "-m", "hpct_slurm.examples.peers.nvrx_ddp", *args.script_args,
                "--ckpt-dir", str(run_dir / "ckpt")]
    active, spares = nodes[:args.active], nodes[args.active:]
    procs: list[subprocess.Popen] = []

    def launch(node: str, role: str) -> None:
        procs.append(_srun(slurm, node, launcher, dict(os.environ),
                           run_dir / f"ft_launcher-{node}.log"))
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
    try:
        return _wait_results(args, run_dir, procs, record)
    finally:
        del store


RUNNERS = {"torchft": run_torchft, "torchft-relaunch": run_torchft,
           "nvrx": run_nvrx_inprocess, "nvrx-injob": run_nvrx_injob}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=sorted(RUNNERS), required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--active", type=int, default=4)
    ap.add_argument("--heartbeat-ms", type=int, default=500)
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.script_args[:1] == ["--"]:
        args.script_args = args.script_args[1:]
    run_dir = Path(args.run_dir)
    nodes = list(SlurmEnv.from_environ().job_nodelist)
    record = Record(run_dir / "driver.jsonl")
    record("peer.start", system=args.system, nodes=nodes)
    return RUNNERS[args.system](args, run_dir, nodes, record)


if __name__ == "__main__":
    sys.exit(main())
