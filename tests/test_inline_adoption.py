"""The inline form's seams (issue 31): `Job.main(main)` around a script whose loop sits in
main(), with fake collaborators (no controller, no sockets). Its path through real faults runs
in tests/test_adoption_cluster.py."""
from __future__ import annotations

import json

import pytest
import torch

from hpct_slurm.errors import HpctError
from hpct_slurm.recovery import DistributedDataParallel, Job
from hpct_slurm.slurm.env import SlurmEnv

from test_job_seams import TASK, fakes, settings  # noqa: F401 - a fixture


def test_a_spare_never_needed_leaves_from_its_job_and_main_returns_none(settings):  # noqa: F811
    made: dict = {}
    after: list[str] = []

    def main() -> str:
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        Job(model, opt, settings=settings, slurm=SlurmEnv.from_environ(TASK), **fakes(made))
        after.append("the loop ran")  # a spare told goodbye never gets here
        return "trained"

    assert Job.main(main) is None
    assert after == [] and made["client"].closed == "done" and made["transfer"].closed
    assert Job._main is None and not Job._in_main  # the next Job.main starts clean
    events = [json.loads(line) for f in (settings.run_dir / "events").iterdir()
              for line in f.read_text().splitlines()]
    assert [e["reason"] for e in events if e["event"] == "rank.exit"] == ["done"]


def test_main_without_a_job_runs_once_and_its_errors_are_its_own():
    calls: list[int] = []

    def main() -> int:
        calls.append(1)
        return 7

    assert Job.main(main) == 7 and calls == [1]

    def broken() -> None:
        raise RuntimeError("a bug before any rank was held")

    with pytest.raises(RuntimeError, match="a bug before any rank"):
        Job.main(broken)  # no rank: nothing to recover, not run again
    assert Job._main is None and not Job._in_main


def test_job_main_runs_once_per_process():
    with pytest.raises(HpctError, match="Job.main is already running"):
        Job.main(lambda: Job.main(lambda: None))
    assert not Job._in_main


def test_the_drop_in_ddp_needs_the_jobs_rank_and_its_model():
    model = torch.nn.Linear(2, 2)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    # torch DDP's surface that needs no group: the module, its parameters, its state_dict keys
    assert ddp.module is model and list(ddp.parameters()) == list(model.parameters())
    assert set(ddp.state_dict()) == {"module.weight", "module.bias"}
    with pytest.raises(HpctError, match=r"runs inside Job.main\(main\), after the script's "
                                        r"Job\(...\) took a rank"):
        ddp(torch.zeros(1, 2))


def test_a_mesh_shape_may_leave_one_dimension_to_the_world_size():
    from hpct_slurm.recovery.generation import sharded_spec
    from hpct_slurm.recovery.layout_rules import resolve_shape

    assert resolve_shape((2, -1), 8) == (2, 4) and resolve_shape((-1,), 4) == (4,)
    assert resolve_shape((2, 2), None) == (2, 2)  # nothing to resolve, nothing needed
    with pytest.raises(HpctError, match=r"needs the job's world size for its -1, and "
                                        r"\$HPCT_WORLD_SIZE is not set"):
        resolve_shape((2, -1), None)
    with pytest.raises(HpctError, match=r"the world size 6 is not a multiple of 4"):
        resolve_shape((4, -1), 6)
    with pytest.raises(HpctError, match="may stand once"):
        resolve_shape((-1, -1), 4)
    spec = sharded_spec(None, None, None, lambda mesh: None, (2, -1), ("replicate", "shard"),
                        None, world_size=6)
    assert spec is not None and spec.shape == (2, 3)
    # inside Job.main a Job without a model registers it later, and makes no mesh itself
    assert sharded_spec(None, None, None, None, None, None, None, late=True) is None
    with pytest.raises(HpctError, match="the script makes its mesh after Job"):
        sharded_spec(None, None, None, None, (2, 2), ("a", "b"), None, late=True)


def test_a_newcomer_reads_back_the_losses_its_rank_recorded(tmp_path):
    """job.losses on a spare that took over a rank (issue 31): the steps its predecessors
    trained come from the run's rank.step events, the latest record of a recomputed step
    wins, other ranks' and later steps are not taken, and torn lines are skipped."""
    from hpct_slurm.recovery.losses import recorded_losses

    events = tmp_path / "events"
    events.mkdir()
    lines = [
        {"t": 1.0, "event": "rank.step", "rank": 2, "step": 0, "loss": 4.0},
        {"t": 2.0, "event": "rank.step", "rank": 2, "step": 1, "loss": 3.5},
        {"t": 3.0, "event": "rank.step", "rank": 1, "step": 1, "loss": 9.9},   # another rank
        {"t": 4.0, "event": "rank.step", "rank": 2, "step": 2, "loss": 3.0},
        {"t": 5.0, "event": "rank.step", "rank": 2, "step": 3, "loss": 2.9},   # after upto
        {"t": 6.0, "event": "rank.step", "rank": 2, "step": 4, "loss": None},  # no loss
    ]
    (events / "n3-0.jsonl").write_text("\n".join(json.dumps(e) for e in lines) + "\n{torn")
    # the same step recomputed later by a survivor's rollback, on another node's file
    (events / "n5-0.jsonl").write_text(json.dumps(
        {"t": 7.0, "event": "rank.step", "rank": 2, "step": 1, "loss": 3.25}) + "\n")
    assert recorded_losses(events, rank=2, upto=2) == {0: 4.0, 1: 3.25, 2: 3.0}
    assert recorded_losses(events, rank=0, upto=9) == {}
    assert recorded_losses(tmp_path / "absent", rank=2, upto=9) == {}


def test_a_settled_store_lets_go_of_the_live_tensors_it_watched():
    """What main() ran before is let go when it runs again (on a GPU, the old model's memory
    beside the new one): after an overlapped commit the store's watch holds the live
    parameters' memory; forget_live lets it go, and the snapshot stays."""
    from hpct_slurm.recovery.snapshot import SnapshotStore
    from hpct_slurm.recovery.state import TrainState

    model = torch.nn.Linear(4, 4)
    store = SnapshotStore(TrainState(model=model), scopes=("shared",))
    store.commit_async(0)
    store.wait()

    def held() -> set[int]:
        return {t.data_ptr() for t in store._async_watch.tensors}

    assert model.weight.data_ptr() in held()  # the control: the commit's watch holds it
    store.forget_live()
    assert held() == set()
    assert store.latest() is not None and store.latest().step == 0
