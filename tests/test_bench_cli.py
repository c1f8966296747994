"""`hpct-slurm bench NAME` end to end for the benchmarks that need no Slurm cluster: the real
command in a subprocess, at its smallest sizes (`--smoke`, or `--sizes`/`--reps` for the
rendezvous sweep), checked for its last-line JSON summary, its result file and its plot.

The cluster benchmarks (recovery, stress, all) are not run here; `bench all`'s exit status is
checked in-process with stand-in benchmarks.
"""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hpct_slurm.bench import all as bench_all
from hpct_slurm.bench.cli import CLUSTER_BENCHMARKS, SMOKE_BENCHMARKS

HPCT_SLURM = str(Path(sys.executable).with_name("hpct-slurm"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# name -> (extra argv, keys the last line must carry)
CASES = {
    "rendezvous": (["--quick", "--sizes", "3", "--reps", "1"],
                   {"bench", "ranks", "rootless_busiest_over_avg", "tcpstore_busiest_over_avg",
                    "rootless_init_s", "tcpstore_init_s", "init_s_per_size", "goals"}),
    "replication": (["--quick", "--smoke"], {"bench", "overhead_pct", "overhead_ci95",
                                             "overhead_paired_median_pct", "pairs",
                                             "persisted_in_pairs", "step_phases_ms",
                                             "added_ms_by_phase"}),
    "transfer": (["--quick", "--smoke"], {"bench", "throughput_ratio"}),
    "teardown": (["--quick", "--smoke"], {"bench", "gc_s", "parts", "old_ready_path_s"}),
    "cache": (["--quick", "--smoke"], {"bench", "reattach_over_cold", "copies_per_node"}),
    "gradients": (["--smoke"], {"bench", "step_s", "vs_torch_ddp", "all_reduce_calls_per_step"}),
    "proof": (["--smoke"], {"bench", "per_size", "added_s", "crosscheck_pct_of_step"}),
}


def _bench(name: str, out: Path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([HPCT_SLURM, "bench", name, *argv, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout)


def test_every_benchmark_without_a_cluster_is_covered():
    assert set(CASES) == SMOKE_BENCHMARKS
    assert not SMOKE_BENCHMARKS & CLUSTER_BENCHMARKS


@pytest.mark.parametrize("name", list(CASES))
def test_bench_cli_prints_summary_and_writes_results(name, tmp_path):
    argv, keys = CASES[name]
    proc = _bench(name, tmp_path, *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert keys <= set(summary), summary
    assert summary["bench"] == name

    record = json.loads((tmp_path / f"{name}.json").read_text())
    assert record["bench"] == name
    machine = record["machine"]
    assert machine["hostname"] and machine["cpu_count"] >= 1 and machine["python"]
    assert machine["torch"]
    png = tmp_path / f"{name}.png"  # every one of these draws a plot
    assert png.read_bytes()[:8] == PNG_MAGIC

    if name == "replication":
        # where a step's time goes, for both sides of the headline's pairs, timed in them
        phases = summary["step_phases_ms"]
        assert set(phases) == {"off", summary["default_mode"]}
        for side in phases.values():
            assert set(side) == {"compute", "reduce", "update", "step_end"}
            assert side["compute"] > 0 and min(side.values()) >= 0
        assert summary["added_ms_by_phase"] == pytest.approx(
            {k: phases[summary["default_mode"]][k] - phases["off"][k] for k in phases["off"]},
            abs=2e-3)

    if name == "rendezvous":
        assert summary["ranks"] == 3 and record["repetitions"] == 1
        assert [s["ranks"] for s in record["sizes"]] == [3]
        # Measured: one rank key per shard, every rank reads all of them.
        assert summary["rootless_busiest_over_avg"] <= 2
        # Structural (one server takes everything), and the file says so.
        assert summary["tcpstore_busiest_over_avg"] == 3
        assert "structural" in record["notes"]["tcpstore_busiest_over_avg"]
        tcp = record["sizes"][-1]["tcpstore"]
        assert tcp["requests_at_root_median"] >= 3 and "measured" in tcp["requests_at_root_source"]
        # Both stores' init time per size, and each goal checked per size.
        assert set(summary["init_s_per_size"]["3"]) == {"rootless", "tcpstore"}
        assert summary["goals"]["rootless_busiest_over_avg_le_2"] == {"3": True}
        assert set(summary["goals"]["rootless_not_slower_than_tcpstore"]) == {"3"}
        # gloo's set + 3 waits + 3 gets reached the rootless store as one round trip over
        # the shard grid (gather.py, grid.py); TCPStore, the baseline, is used as torch uses it.
        assert record["sizes"][-1]["rootless"]["client_ops_of_one_rank_last_run"] == {
            "gather": 1}
        assert tcp["client_ops_of_one_rank_last_run"] == {"set": 1, "wait": 3, "get": 3}
    else:
        assert record["smoke"] is True
    if name == "gradients":
        # counted in the ranks: one all_reduce per gradient before, one per chunk now
        calls = summary["all_reduce_calls_per_step"]
        assert calls["per_parameter"] == summary["gradients"] > calls["canonical"] == 1


@pytest.mark.parametrize("argv,message", [
    (["replication", "--sizes", "2,4"], "--sizes only applies to the rendezvous benchmark"),
    (["transfer", "--reps", "2"], "--reps only applies to the rendezvous and replication "
                                  "benchmarks"),
    (["recovery", "--smoke"], "--smoke only applies to cache, gpu, gradients, proof, rendezvous, "
                              "replication, teardown, transfer"),
    (["rendezvous", "--reps", "0"], "--reps 0 must be at least 1"),
])
def test_bench_cli_rejects_options_that_do_not_apply(argv, message, tmp_path, capsys):
    from hpct_slurm.cli import main

    assert main(["bench", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # rejected before anything ran


def test_bench_cli_rejects_a_size_below_two(tmp_path):
    proc = _bench("rendezvous", tmp_path, "--sizes", "1,4", timeout=60)
    assert proc.returncode == 2 and "at least 2 ranks" in proc.stderr


def test_small_rendezvous_sizes_get_more_formations():
    from hpct_slurm.bench.rendezvous import formations

    # A 4-rank formation takes milliseconds: its median needs the sample a 16-rank one has.
    assert [formations(n, 5) for n in (2, 4, 8, 16, 32, 64)] == [40, 20, 10, 5, 5, 5]


def test_all_exit_code():
    assert bench_all.exit_code({"bench": "all", "ok": ["a", "b"], "failed": []}) == 0
    assert bench_all.exit_code({"bench": "all", "ok": ["a"], "failed": ["b"]}) == 1


def test_bench_all_exits_nonzero_when_a_benchmark_failed(tmp_path, monkeypatch, capsys):
    """One failing benchmark: the others still run, the table shows it, the exit status is 1."""
    from hpct_slurm.cli import main

    def fake(name: str, fail: bool) -> None:
        def run(out_dir: Path, quick: bool = False) -> dict:
            if fail:
                raise RuntimeError("boom")
            return {"bench": name, "value": 1}
        module = types.ModuleType(f"hpct_slurm.bench.{name}")
        module.run = run  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)

    fake("fake_ok", False)
    fake("fake_fail", True)
    monkeypatch.setattr(bench_all, "SUITE", (("fake_ok", False), ("fake_fail", False),
                                             ("fake_ok2", False)))
    fake("fake_ok2", False)
    assert main(["bench", "all", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED: RuntimeError: boom" in out
    last = json.loads(out.strip().splitlines()[-1])
    # the goodput model runs last on whatever results there are (the defaults here)
    assert last["failed"] == ["fake_fail"] and last["ok"] == ["fake_ok", "fake_ok2", "goodput"]
    assert (tmp_path / "goodput.json").exists() and (tmp_path / "goodput.png").exists()
    record = json.loads((tmp_path / "all.json").read_text())
    assert "boom" in record["results"]["fake_fail"]["error"]

    monkeypatch.setattr(bench_all, "SUITE", (("fake_ok", False),))
    assert main(["bench", "all", "--out", str(tmp_path)]) == 0


def test_bench_store_scale_counts_requests_on_real_shard_servers(tmp_path):
    """--quick: 288 shard servers, each pattern with and without fan-out (~15 s)."""
    proc = _bench("store_scale", tmp_path, "--quick")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "store_scale" and summary["hosts"] == 288
    # The world id's shard serves every rank without fan-out; with it, no shard is hot.
    assert summary["nccl_plain_busiest_over_average"] > 50
    assert summary["nccl_fanout_busiest_over_average"] <= 2
    assert summary["gloo_plain_busiest_over_average"] <= 2
    assert summary["servers_match_model"] is True and summary["goal_met"] is True
    record = json.loads((tmp_path / "store_scale.json").read_text())
    assert "shard servers" in record["source"]
    assert set(record["results"]) == {"gloo/plain/288", "gloo/fanout/288", "nccl/plain/288",
                                      "nccl/fanout/288", "nccl/fanout_spanning/288"}
    fanned = record["results"]["nccl/fanout/288"]
    assert fanned["shards"] == 288 and fanned["requests"] > record["results"][
        "nccl/plain/288"]["requests"]  # the writers' copies, counted where they landed
    assert (tmp_path / "store_scale.png").read_bytes()[:8] == PNG_MAGIC


def test_bench_gpu_runs_where_a_gpu_is_and_says_why_not_where_none_is(tmp_path):
    """`bench gpu` (scripts/gpu-check.sh) on the machine at hand: its summary where torch
    sees a CUDA device; elsewhere (CI) a one-line refusal naming what is missing."""
    import torch

    proc = _bench("gpu", tmp_path, "--smoke")
    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        assert {"bench", "overhead_pct", "restore_speed_of_raw", "bitwise_equal"} <= set(summary)
        assert all(summary["bitwise_equal"].values()), summary
    else:
        assert proc.returncode != 0
        assert "bench gpu needs a CUDA device" in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


def test_the_paired_headline_counts_a_rare_cost_and_says_how_sure_it_is():
    """`bench replication`'s headline estimator: the ratio of the pairs' totals counts a cost
    that lands in one pair in twenty (a persisted file); the median pair does not; each
    comes with a resampled interval around it, the same for the same pairs."""
    from hpct_slurm.bench.replication import paired_overhead

    pairs = [(1.0, 1.02 + 0.01 * (i % 3 - 1)) for i in range(40)]
    pairs[7] = (1.0, 3.0)  # one pair held the file: +200 % alone
    got = paired_overhead(pairs)
    total = (sum(b for _, b in pairs) / sum(a for a, _ in pairs) - 1) * 100
    assert got["mean_pct"] == round(total, 1) and got["mean_pct"] > 6
    assert got["median_pct"] == 2.0
    lo, hi = got["median_ci95"]
    assert lo <= 2.0 <= hi and hi - lo <= 2.0
    lo, hi = got["mean_ci95"]
    assert lo <= got["mean_pct"] <= hi and lo < hi
    assert got["spread"] == [1.0, 200.0]
    assert paired_overhead(pairs) == got
    with pytest.raises(ValueError, match="no pairs"):
        paired_overhead([])
