"""Never silently wrong, for the scripts people write (issue 42), on the real cluster: a GAN
with two models and two optimizers, each in the drop-in DDP, and an EMA of the generator
updated every step, the loop inline (hpct_slurm/examples/adopted_gan.py). Its extra state is
registered either as Job(...)'s keyword arguments or with job.state.register after Job(...),
which on a restart once left the old objects registered to receive the restore (the EMA came
back silently wrong) and on a spare refused the snapshot (the job failed).

Each run is crashed at step 0, mid-run or inside the update window (the discriminator updated,
the generator's gradients not yet reduced), by a node crash, a killed rank or an in-place
fault. Every rank's generator, discriminator and EMA must end bit-identical to the run without
a fault, every restore proven, at most one step recomputed. A script that resets the EMA after
the restore is caught by the proof and never trains on."""
from __future__ import annotations

import sys

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, UNPACED, collect, controller_events,
                                          rank_events, recomputed_steps, step_events, submit,
                                          wait_job)

pytestmark = pytest.mark.cluster
EPOCHS, STEPS_PER_EPOCH, WORLD = 2, 8, 4   # 512 samples / (4 ranks x batch 16)


def _gan(*extra: str) -> list[str]:
    return [sys.executable, "-m", "hpct_slurm.examples.adopted_gan", "--epochs", str(EPOCHS),
            "--step-sleep", "0.05", *extra]


@pytest.fixture(scope="module")
def reference(_session_cluster, tmp_path_factory):
    _session_cluster.heal()
    d = tmp_path_factory.mktemp("gan-reference")
    wait_job(_session_cluster, submit(_session_cluster, d, TEMPLATE, [*_gan(), *UNPACED]), d,
             240, label="gan-reference")
    return {r: res["params_sha256"] for r, res in collect(d, WORLD).items()}


@pytest.mark.parametrize("register, fault, kill_at", [
    ("after", ["--fail-at", "0"], None),                          # in place, step 0
    ("after", [], 9),                                             # node crash, mid-run
    ("after", ["--die-at", "11", "--phase", "window"], None),     # rank killed in the window
    ("job", [], 0),                                               # node crash, step 0
    ("job", ["--fail-at", "12", "--phase", "window"], None),      # in place, in the window
], ids=["after-inplace-step0", "after-crash-mid", "after-die-in-window", "job-crash-step0",
        "job-inplace-in-window"])
def test_gan_with_ema_recovers_bit_identical_with_at_most_one_step_recomputed(
        cluster, reference, tmp_path, register, fault, kill_at):
    jid = submit(cluster, tmp_path, TEMPLATE, _gan("--register", register, *fault))
    wait_job(cluster, jid, tmp_path, 240, kill_at=kill_at, label=f"gan-{register}")
    got = {r: res["params_sha256"] for r, res in collect(tmp_path, WORLD).items()}
    assert got == reference  # generator, discriminator and EMA, every rank
    assert {e["step"] for e in step_events(tmp_path)} == set(range(EPOCHS * STEPS_PER_EPOCH))
    done = [e for e in controller_events(tmp_path) if e["event"] == "recovery.done"]
    assert len(done) == 1
    # one fault, one step at most computed again, on any rank
    assert recomputed_steps(tmp_path) <= WORLD
    proven = [e for e in rank_events(tmp_path) if e["event"] == "restore.proven"]
    assert sorted(e["rank"] for e in proven) == list(range(WORLD))
    assert all({"model", "ema", "disc", "disc_opt"} <= set(e["names"]) for e in proven)
    assert not [e for e in rank_events(tmp_path) if e["event"] == "restore.unproven"]


def test_an_ema_reset_after_the_restore_is_caught_and_never_trained_on(cluster, tmp_path):
    jid = submit(cluster, tmp_path, TEMPLATE,
                 _gan("--register", "after", "--fail-at", "5", "--reset-ema"))
    wait_job(cluster, jid, tmp_path, 240, label="gan-reset-ema")
    unproven = [e for e in rank_events(tmp_path) if e["event"] == "restore.unproven"]
    assert unproven and all(p.startswith("ema: the registered AveragedModel does not hold")
                            for e in unproven for p in e["problems"])
    # no step after the restored one was ever trained, and the job says it is the script's
    assert max(e["step"] for e in step_events(tmp_path)) == 4
    failed = [e for e in controller_events(tmp_path) if e["event"] == "job.failed"]
    assert failed and failed[0]["cause"] == "script"
    assert not (tmp_path / "results").exists()
