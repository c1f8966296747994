"""Tier 1 on the real cluster: plain `srun` across nodes in separate network namespaces, no
MASTER_ADDR/PORT set by hand, gloo formed over the rootless store."""
from __future__ import annotations

import json
import sys
import time

import pytest

from hpct_slurm import protocol as P

pytestmark = pytest.mark.cluster

TASK = """
import json, os, sys, torch, torch.distributed as dist
from hpct_slurm.rendezvous import init_from_slurm
assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
info = init_from_slurm(generation=0, backend="gloo")
t = torch.tensor([float(info.rank + 1)])
dist.all_reduce(t)
print(json.dumps({"rank": info.rank, "world": info.world_size, "node": info.node_name,
                  "addr": info.addresses[info.node_rank], "ifname": info.ifname,
                  "sum": t.item(), "master": info.master_addr}), flush=True)
dist.barrier()
"""


def test_gloo_allreduce_over_rootless_store_across_real_nodes(cluster, tmp_path):
    secret = tmp_path / "secret"
    P.new_secret_file(secret)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n"
                      f'srun -N3 -n6 --ntasks-per-node=2 "{sys.executable}" -c "$TASK"\n')
    out = tmp_path / "out.txt"
    proc = cluster.run(["sbatch", "--parsable", "-N3", "--exclusive", f"--output={out}",
                        str(script)], check=True,
                       env={"TASK": TASK, "HPCT_SECRET_FILE": str(secret)})
    job = int(proc.stdout.strip())
    deadline = time.monotonic() + 120
    while cluster.run(["squeue", "-h", "-j", str(job)]).stdout.strip():
        assert time.monotonic() < deadline, "rendezvous job did not finish"
        time.sleep(0.3)
    records = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    lines = [r for r in records if "event" not in r]  # the shards also log JSON events
    assert len(lines) == 6, out.read_text()
    assert sorted(r["rank"] for r in lines) == list(range(6))
    assert {r["sum"] for r in lines} == {21.0}  # 1 + 2 + ... + 6 on every rank
    nodes = {r["node"] for r in lines}
    assert len(nodes) == 3 and len({r["addr"] for r in lines}) == 3  # distinct hosts
    assert {r["ifname"] for r in lines} == {"eth0"}
