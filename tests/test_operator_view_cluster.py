"""Issue 45.4, on the real local cluster: what an operator reads after a job failed on its
script's own error. One fault per fault (in `status` and in Slurm's comment alike), and the
script's traceback, its file and line, in the rank's log and in its `rank.fault`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, controller_events, rank_events, submit,
                                          wait_finished)

pytestmark = pytest.mark.cluster
TRAIN = [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", "12",
         "--step-sleep", "0.02", "--script-error-at", "3", "--fault-rank", "1"]


def test_a_script_error_is_one_fault_with_the_scripts_own_traceback(cluster, tmp_path):
    jid = submit(cluster, tmp_path, TEMPLATE, TRAIN, nodes=3,
                 env={"HPCT_ACTIVE_NODES": "2", "HPCT_SPARE_NODES": "1"})
    wait_finished(cluster, jid, 240, "the job with a bug in its script")
    evs = controller_events(tmp_path)
    print(json.dumps(evs, indent=None))
    out = subprocess.run([str(Path(sys.executable).parent / "hpct-slurm"), "status",
                          str(tmp_path), "--json"], capture_output=True, text=True, timeout=60)
    print(out.stdout, out.stderr)
    print(cluster.client().show_job(jid))
    for f in sorted((tmp_path / "logs").glob("*.out")):
        print(f, f.read_text()[-3000:])
    print([e for e in rank_events(tmp_path) if e["event"] == "rank.fault"])
    assert False
