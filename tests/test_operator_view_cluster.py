"""Issue 45.4, on the real local cluster: what an operator reads after a job failed on its
script's own error (a layer called with the wrong shape in step 3 on rank 1, in every
generation). One fault per fault, in `status` and in Slurm's comment alike (the old
controller's comment said 1 while `status` listed every rank's goodbye as a `connection lost`
fault), and the script's traceback, its file and line, in the rank's log and in its
`rank.fault` (before: an empty log, and only torch's frames)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, controller_events, rank_events, submit,
                                          wait_finished)

pytestmark = pytest.mark.cluster
TRAIN = [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", "12",
         "--step-sleep", "0.02", "--script-error-at", "3", "--fault-rank", "1"]


def test_a_script_error_is_counted_once_per_fault_with_the_scripts_own_traceback(cluster,
                                                                                 tmp_path):
    jid = submit(cluster, tmp_path, TEMPLATE, TRAIN, nodes=3,
                 env={"HPCT_ACTIVE_NODES": "2", "HPCT_SPARE_NODES": "1"})
    wait_finished(cluster, jid, 240, "the job with a bug in its script")
    evs = controller_events(tmp_path)
    (failed,) = [e for e in evs if e["event"] == "job.failed"]
    assert failed["cause"] == "script"
    assert "mat1 and mat2 shapes cannot be multiplied" in failed["reason"]
    # the ranks' goodbyes after the end are no faults
    assert not [e for e in evs if e["event"] == "fault.detected" and e["t"] > failed["t"]]

    out = subprocess.run([str(Path(sys.executable).parent / "hpct-slurm"), "status",
                          str(tmp_path), "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    faults = json.loads(out.stdout)["faults"]
    assert faults and {f["reason"] for f in faults} == {"rank reported a fault"}
    comment = cluster.client().show_job(jid).comment or ""
    said = re.match(r"hpct: (\d+) fault\(s\)", comment)
    assert said and int(said.group(1)) == len(faults), (comment, faults)

    # the script's line, in rank 1's rank.fault and in its node's log
    (first,) = [e for e in rank_events(tmp_path)
                if e["event"] == "rank.fault" and e["rank"] == 1 and e["generation"] == 0]
    assert first["where"].startswith("linear.py:")
    assert re.search(r" < \.\.\. < train\.py:\d+ in wrong_shape$", first["where"]), first
    node = first["source"].split("/")[0]
    log = (tmp_path / "logs" / f"{node}.out").read_text()
    assert "a fault ended this rank's generation" in log
    assert re.search(r'train\.py", line \d+, in wrong_shape', log), log[-2000:]
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x5 and 3x4)" in log
