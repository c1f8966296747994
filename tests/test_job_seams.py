"""`Job` apart from its side effects: built from a frozen `JobSettings` and fake collaborators
(no controller, no sockets), it registers nothing until `run`; `run` then binds the transfer
server, connects and registers, and a Goodbye ends it. Seconds, no cluster."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from hpct_slurm import config as C
from hpct_slurm import protocol as P
from hpct_slurm.config import JobSettings
from hpct_slurm.errors import HpctError
from hpct_slurm.recovery.job import Job
from hpct_slurm.slurm.env import SlurmEnv

TASK = {"SLURM_JOB_ID": "31", "SLURM_JOB_NODELIST": "localhost",
        "SLURMD_NODENAME": "localhost", "SLURM_STEP_NODELIST": "localhost",
        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
        "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"}


class FakeTransfer:
    def __init__(self, secret, job_id, **kw):
        self.kw, self.address, self.closed = kw, ("127.0.0.1", 4242), False
        self.rank, self.corrupt_on_serve = kw["rank"], False

    def close(self) -> None:
        self.closed = True


class FakeClient:
    def __init__(self, address, secret, job_id, events):
        self.address, self.job_id = address, job_id
        self.registered: tuple | None = None
        self.closed: str | None = None
        self.inbox = [P.Goodbye(reason="done")]
        self.keep_fds: set[int] = set()

    def register(self, *args) -> None:
        self.registered = args

    def next_assignment(self):
        return self.inbox.pop(0)

    def close(self, reason: str) -> None:
        self.closed = reason


@pytest.fixture
def settings(tmp_path) -> JobSettings:
    secret = tmp_path / "secret"
    P.new_secret_file(secret)
    return JobSettings(controller="127.0.0.1:9", secret_file=str(secret),
                       run_dir=tmp_path / "run", collective_timeout_s=7.0)


def fakes(made: dict) -> dict:
    """Job's `transfer` and `client` factories, making fakes kept in `made` by name."""
    def transfer(*a, **k):
        made["transfer"] = FakeTransfer(*a, **k)
        return made["transfer"]

    def client(*a, **k):
        made["client"] = FakeClient(*a, **k)
        return made["client"]

    return {"transfer": transfer, "client": client}


def _job(settings: JobSettings, **kw) -> tuple[Job, dict]:
    made: dict = {}
    model = torch.nn.Linear(2, 2)
    job = Job(model, torch.optim.SGD(model.parameters(), lr=0.1), settings=settings,
              slurm=SlurmEnv.from_environ(TASK), **fakes(made), **kw)
    return job, made


def test_construction_is_configuration_only(settings):
    job, made = _job(settings)
    assert made == {}  # no socket bound, no connection, no registration
    assert job.client is None and job.transfer is None
    assert job.settings is settings and job.collective_timeout_s == 7.0
    assert job.store_kind == "rootless" and job.role == "active"
    # plain data parallelism without per-rank state: just-in-time recovery, lazy commits
    assert job.mode == "jit" and job.lazy and job.snapshots.every > 1
    assert not (settings.run_dir / "events").exists() or not any(
        (settings.run_dir / "events").iterdir())


def test_explicit_argument_wins_over_the_settings(settings):
    job, _ = _job(replace(settings, recovery_mode="jit", persist_every=3,
                          snapshot_lazy=False), recovery_mode="replicated", persist_every=5)
    assert job.mode == "replicated" and job.persist_every == 5
    job, _ = _job(replace(settings, recovery_mode="replicated", snapshot_every=4))
    assert job.mode == "replicated" and job.snapshots.every == 4


def test_run_registers_then_a_goodbye_ends_it(settings):
    job, made = _job(settings)
    assert job.run(lambda step: 0.0, 3) is False  # a spare never needed: not trained
    client, transfer = made["client"], made["transfer"]
    assert client.registered == ("localhost", 0, "active", job.host_addr, 4242)
    assert client.address.port == 9 and client.job_id == "31"
    assert transfer.closed and client.closed == "done"
    events = [json.loads(line) for f in (settings.run_dir / "events").iterdir()
              for line in f.read_text().splitlines()]
    registered = [e for e in events if e["event"] == "rank.registered"]
    assert registered[0]["settings"] == {"collective_timeout_s": 7.0, "init_timeout_s": 30.0,
                                         "store": "rootless"}


def test_job_settings_come_from_the_controllers_environment(settings, tmp_path):
    env = {C.CONTROLLER_ADDR: "10.0.0.1:4000", C.SECRET_FILE: settings.secret_file,
           C.RUN_DIR: str(tmp_path), C.ROLE: "spare", C.STORE: "tcpstore",
           C.COLLECTIVE_TIMEOUT_S: "12.5", C.SNAPSHOT_OVERLAP: "0", C.SNAPSHOT_LAZY: "0",
           C.FAULT_CORRUPT_SERVE: "1,3", C.JOB_ID: "77"}
    s = JobSettings.from_environ(env)
    assert (s.role, s.store, s.collective_timeout_s, s.init_timeout_s) == (
        "spare", "tcpstore", 12.5, 30.0)
    assert (s.snapshot_overlap, s.snapshot_lazy, s.corrupt_serve, s.served_job_id) == (
        "0", False, frozenset({1, 3}), 77)
    job, _ = _job(s)
    assert job.slurm.job_id == 77  # a pool spare serves the main job
    with pytest.raises(C.SettingError, match="HPCT_CONTROLLER is not set: run the training "
                                             "script under `hpct-slurm controller`"):
        JobSettings.from_environ({k: v for k, v in env.items() if k != C.CONTROLLER_ADDR})
    with pytest.raises(HpctError, match="HPCT_SNAPSHOT_LAZY 'yes' is not one of 1, 0"):
        JobSettings.from_environ({**env, C.SNAPSHOT_LAZY: "yes"})


class FakeRelay:
    def __init__(self, controller, secret, job_id, node, role, local_rank, events):
        self.args = (controller.port, job_id, node, role, local_rank)
        self.address, self.upstream_fd, self.closed = ("127.0.0.1", 4343), 99, False

    def close(self) -> None:
        self.closed = True


def test_a_relayed_nodes_first_rank_runs_its_relay_and_the_others_find_it(settings):
    """HPCT_RELAY (a node of several ranks): local rank 0 starts the node's relay and
    publishes its port in the run dir; every local rank's client connects there; the relay's
    controller link is kept from a STOP's cut, and closes after its rank's goodbye."""
    from hpct_slurm.recovery.client import ControllerAddress
    from hpct_slurm.relay.node import relay_file

    relays: list[FakeRelay] = []

    def relay(*a, **k):
        relays.append(FakeRelay(*a, **k))
        return relays[-1]

    relayed = replace(settings, relay=True)
    job, made = _job(relayed, relay=relay)
    job.run(lambda step: 0.0, 3)
    [r] = relays
    assert r.args == (9, "31", "localhost", "active", 0)  # to the controller, as this node
    assert made["client"].address == ControllerAddress("127.0.0.1", 4343)
    assert made["client"].keep_fds == {99} and r.closed
    path = relay_file(settings.run_dir, "31", 0, None, "localhost")
    assert path.read_text() == "127.0.0.1:4343"

    def no_relay(*a, **k):
        raise AssertionError("only the first local rank runs the relay")

    other = Job(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(),
                                                          lr=0.1),
                settings=relayed, slurm=SlurmEnv.from_environ({**TASK, "SLURM_LOCALID": "1",
                                                               "SLURM_PROCID": "1",
                                                               "SLURM_NTASKS": "2",
                                                               "SLURM_TASKS_PER_NODE": "2"}),
                transfer=FakeTransfer, client=lambda *a, **k: made.setdefault(
                    "other", FakeClient(*a, **k)), relay=no_relay)
    other.run(lambda step: 0.0, 3)
    assert made["other"].address == ControllerAddress("127.0.0.1", 4343)
    assert made["other"].keep_fds == set() and other.relay is None
    # without HPCT_RELAY nothing changes: the controller's own address
    job, made = _job(settings, relay=no_relay)
    job.run(lambda step: 0.0, 3)
    assert made["client"].address.port == 9


class RecoveringClient(FakeClient):
    """What `_recover` and `_prefetch` use of the controller connection, recorded."""

    def __init__(self, *a, **k):
        import threading

        super().__init__(*a, **k)
        self.stop_reason, self.state, self.step = "", "running", -1
        self.stop_event, self.closed = threading.Event(), threading.Event()
        self.reports: list = []
        self.states: list[str] = []
        self.left = 0

    def leave_group(self) -> None:
        self.left += 1

    def say_goodbye(self, reason: str, answer_within_s: float) -> None:
        self.closed.set()
        self.goodbye = reason

    def report_holdings(self, holdings) -> None:
        self.reports.append(holdings)

    def heartbeat_now(self) -> None:
        self.states.append(self.state)


def _events(settings: JobSettings) -> list[dict]:
    return [json.loads(line) for f in (settings.run_dir / "events").iterdir()
            for line in f.read_text().splitlines()]


def test_a_survivor_reports_ready_before_its_broken_group_is_torn_down(settings, monkeypatch):
    """Issue 15: the teardown (gc, gloo's destructor) runs while the controller decides and the
    spare pulls; the next formation waits for it; one that hangs ends the process there."""
    import threading

    import hpct_slurm.recovery.rank_round as RR
    from hpct_slurm.recovery.generation import _TeardownHung

    job, _ = _job(settings)
    job._make_client = RecoveringClient
    job._start()
    release, finished = threading.Event(), threading.Event()

    def slow_teardown() -> None:
        release.wait(10)
        finished.set()

    monkeypatch.setattr(job._group, "teardown", slow_teardown)
    job._recover("RuntimeError: peer gone")
    assert job.client.states == ["ready"] and not finished.is_set()
    ready = [e for e in _events(settings) if e["event"] == "rank.ready"]
    assert ready and ready[0]["healthy"]
    release.set()
    job._await_teardown()  # what _adopt does before forming the next group
    assert finished.is_set() and job._teardown_bg is None

    def hung() -> None:
        raise _TeardownHung("process group teardown did not finish within 20 s")

    exits: list[int] = []
    monkeypatch.setattr(job._group, "teardown", hung)
    monkeypatch.setattr(RR.os, "_exit", lambda code: exits.append(code))
    job._recover("RuntimeError: peer gone")
    job._await_teardown()
    assert exits == [3]
    assert [e for e in _events(settings) if e["event"] == "rank.teardown_hung"]


def test_a_rank_that_leaves_a_step_on_its_own_cuts_its_group_and_a_stopped_one_does_not(
        settings, monkeypatch):
    """A rank whose step raised before any STOP (its own error, or a peer's connection
    error) cuts its whole group's connections, so a peer blocked reading from it fails now
    instead of at the collective timeout; a rank that left because a STOP came (the STOP's
    cut is the controller's to decide), or whose controller is gone, cuts nothing itself."""
    job, _ = _job(settings)
    job._make_client = RecoveringClient
    job._start()
    monkeypatch.setattr(job._group, "teardown", lambda: None)
    job._recover("RuntimeError: an error of the script's step")
    assert job.client.left == 1
    job._await_teardown()
    job.client.stop_event.set()
    job._recover("_Stopped: n2: connection lost")
    assert job.client.left == 1
    job._await_teardown()
    job.client.stop_event.clear()
    job.client.closed.set()
    job._recover("_Stopped: controller connection lost")
    assert job.client.left == 1


def test_an_error_the_script_repeats_anywhere_is_told_the_controller_before_the_rank_exits(
        settings):
    """A TypeError (or a registration mistake, a KeyError, ...) would be raised again on any
    node: the rank tells the controller (the job fails as the script's, no node fenced);
    a collective's RuntimeError or an OSError, which a node may cause, is not told, nor an
    error before this process held a rank, nor twice."""
    from hpct_slurm import protocol as P

    job, _ = _job(settings)
    job._make_client = RecoveringClient
    job._start()
    for not_told in (RuntimeError("gloo: connection closed"), OSError(28, "No space left")):
        job._script_failed(not_told)
        assert not job.client.closed.is_set()
    job.rank = -1
    job._script_failed(TypeError("a spare's mistake before it held a rank"))
    assert not job.client.closed.is_set()
    job.rank = 2
    job._script_failed(TypeError("'NoneType' object is not callable"))
    assert job.client.goodbye == P.SCRIPT_ERROR + "TypeError: 'NoneType' object is not callable"
    job._script_failed(KeyError("again"))  # told once: the connection is closed
    assert job.client.goodbye.endswith("not callable")
    [told] = [e for e in _events(settings) if e["event"] == "rank.script_error"]
    assert told["rank"] == 2 and told["error"].startswith("TypeError")


def test_a_newcomer_pulls_striped_from_every_source_of_its_key_while_it_forms(settings):
    import socket

    job, _ = _job(settings)
    job._start()
    dead = []
    for _ in range(2):  # two survivors whose transfer servers are gone
        with socket.create_server(("127.0.0.1", 0)) as s:
            dead.append(s.getsockname()[:2])
    a = P.Assign(1, 2, 3, ["n1", "n2", "n3"], 1, 7, {0: [dead[0]], 1: [dead[1]]}, [2], 3, {})
    lacking = job._prefetch(a, survivor=True)  # a survivor a step behind pulls too
    assert lacking is not None and lacking.result() is None
    job.snapshots.commit(7)
    assert job._prefetch(a, survivor=True) is None  # one holding the step restores itself
    assert job._prefetch(P.Assign(1, 2, 3, ["n1", "n2", "n3"], 1, -1, a.sources, [2], 3, {}),
                         survivor=False) is None  # nothing to restore: the state at creation
    got = job._prefetch(a, survivor=False)
    assert got is not None and got.step == 7
    assert got.result() is None  # no such sources here: None, and the restore falls back
    failed = [e for e in _events(settings) if e["event"] == "transfer.source_failed"]
    assert {e["source"] for e in failed} >= {f"{h}:{p}" for h, p in dead}


def test_a_step_the_stop_dooms_is_abandoned_in_its_forward_or_backward_not_after_its_update(
        settings):
    """A STOP naming lost nodes means the step in progress can never complete: a survivor
    leaves it at the next module or gradient instead of computing on to its allreduce. Not a
    STOP that loses nobody (a planned move: the step completes), nor once the update began."""
    import threading

    from hpct_slurm.recovery.generation import _Stopped

    job, _ = _job(settings)
    job._make_client = RecoveringClient
    job._start()
    job._hook_model()
    c = job.client
    c.stop_event, c.stop_generation, c.stop_doomed = threading.Event(), 0, False
    job.generation = 0
    x = torch.ones(1, 2)
    c.stop_event.set()
    c.stop_reason = "n3: connection lost"
    job.model(x).sum().backward()  # a STOP that loses nobody: the step goes on
    c.stop_doomed = True
    with pytest.raises(_Stopped, match="n3: connection lost"):
        job.model(x)
    c.stop_event.clear()
    loss = job.model(x).sum()
    c.stop_event.set()  # the STOP arrives between forward and backward
    with pytest.raises(_Stopped):
        loss.backward()
    job._before_update()  # the optimizer step began: the live state is no step's any more
    job.model(x).sum().backward()
    job._updating = False
    c.state = "ready"  # not training (recovering, done): never raised
    job.model(x)
