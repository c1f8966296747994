"""`hpct-slurm bench peers` on the real local cluster, shortened: torchft in its spare mode
(issue 44) through one crash of node n3 at a random moment, so that the peer harness cannot rot
silently. hpct-slurm's side of the bench is the adopted inline script through a crash, which
test_adoption_cluster.py runs (and the yardstick is tested on recorded shapes of every system
in test_bench_peers.py); running it here again would cost the suite ~40 s. torchft comes from
the `peers` extra (scripts/setup.sh installs it): without it this test fails, saying so."""
from __future__ import annotations

import json

import pytest

from hpct_slurm.bench import peers as P

pytestmark = pytest.mark.cluster
# 48 steps of about 0.3 s, one crash after step 6-9: the spare group takes the lost one's place
# at the next quorum, so the run after it need not outlast a relaunch.
CFG = P.Config(epochs=6, kill_at=6, spread=4, step_sleep=0.2, crashes=1, timeout_s=180)


def test_bench_peers_runs_torchft_with_a_live_spare_through_the_crash(cluster, tmp_path):
    try:
        P.version("torchft")
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"torchft is not installed, so the peers bench cannot be tested: {exc}")
    results = P.compare(cluster, tmp_path / "work", CFG, ("torchft",))
    summary = P.write(tmp_path / "out", results, CFG, True, tmp_path / "work", 0.0)
    tft = results["torchft"]
    assert "error" not in tft, tft
    run, = tft["runs"]
    assert "error" not in run, run
    assert set(tft) >= {"runs", "seconds_lost_median", "back_to_speed_s_median",
                        "lost_steps_median", "bitwise_equal", "given", "version"}
    # the live spare took the lost group's place: every data shard trained at full world size
    # again (the yardstick raises otherwise), with nothing recomputed and no batch left out
    # (the failed step was retried on the same batches), the four groups on one model
    assert run["back_to_full_world_s"] > 0 and run["back_to_speed_s"] >= \
        run["back_to_full_world_s"]
    assert run["lost_steps"] == 0 and run["skipped_batches"] == 0
    assert tft["version"] == "0.2.0" and "FIXED_WITH_SPARES" in tft["given"]["mode"]
    assert 0 <= run["moment"] and run["after_step"] >= CFG.kill_at
    # the record: the last line's JSON object and the file and plot
    assert json.loads(json.dumps(summary))["systems"].keys() == {"torchft"}
    record = json.loads(open(summary["json"]).read())
    assert record["systems"] == json.loads(json.dumps(results))
    assert open(summary["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
