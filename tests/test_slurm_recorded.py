"""The Slurm parsers on output RECORDED from each Slurm release this project was run against
(tests/data/slurm/<release>/, made by scripts/record-slurm-output.sh on a 3-node local cluster:
a failed job, a running job with a step on n1, n2 drained, n3 down, a pending job, a MAINT
reservation). The same scene on every release, so one set of expectations; and a read that
cannot be understood raises an HpctError naming the command and the field, never [].
All offline: the client's `runner` answers from the recordings."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hpct_slurm.errors import HpctError
from hpct_slurm.slurm.client import (
    SlurmClient, parse_job_record, parse_job_state, parse_node_record, parse_node_states,
    parse_reservations, parse_sbatch_parsable, parse_scontrol_nodes_json, parse_sinfo_json,
    parse_squeue_json, parse_steps, parse_version, sinfo_json_has_nodes)
from hpct_slurm.slurm.hostlist import expand

DATA = Path(__file__).parent / "data" / "slurm"
RELEASES = sorted(p.name for p in DATA.iterdir() if p.is_dir())


def test_every_release_the_docs_name_is_recorded() -> None:
    assert {"22.05", "24.11"} <= set(RELEASES)


class Recorded:
    def __init__(self, release: str):
        self.release = release
        self.dir = DATA / release
        ids = dict(kv.split("=") for kv in self.text("jobs.txt").split())
        self.failed, self.running, self.pending = (int(ids[k]) for k in
                                                   ("failed", "running", "pending"))

    def text(self, name: str) -> str:
        return (self.dir / name).read_text()

    def rc(self, name: str) -> int:
        path = self.dir / f"{name}.rc"
        return int(path.read_text()) if path.exists() else 0

    def stderr(self, name: str) -> str:
        path = self.dir / f"{name}.stderr"
        return path.read_text() if path.exists() else ""

    @property
    def newer(self) -> bool:
        """data_parser releases (23.02 on), not 22.05's openapi v0.0.38."""
        return self.release != "22.05"

    def runner(self, calls: list[list[str]]):
        files = {("sinfo", "--json"): "sinfo.json",
                 ("squeue", "--json", "--states=all"): "squeue.json",
                 ("scontrol", "show", "nodes", "--json"): "scontrol-show-nodes.json"}

        def run(argv, **kwargs) -> subprocess.CompletedProcess:
            calls.append(list(argv))
            name = files[tuple(argv)]
            return subprocess.CompletedProcess(argv, self.rc(name), stdout=self.text(name),
                                               stderr=self.stderr(name))
        return run


@pytest.fixture(params=RELEASES)
def rec(request) -> Recorded:
    return Recorded(request.param)


def test_version(rec: Recorded) -> None:
    assert parse_version(rec.text("version.txt")).startswith(rec.release + ".")


def _check_scene_nodes(nodes, with_addr: bool) -> None:
    by = {n.name: n for n in nodes}
    assert sorted(by) == ["n1", "n2", "n3"]
    n1, n2, n3 = by["n1"], by["n2"], by["n3"]
    assert (n1.state, n1.flags, n1.reason) == ("MIXED", frozenset(), None) and n1.usable
    assert n1.features == ("a", "hpct_spare") and n1.active_features == ("a",)
    assert n1.comment == "hpct: spare pool add"
    assert (n2.state, n2.flags, n2.summary) == ("IDLE", {"DRAIN"}, "DRAINED")
    assert n2.reason == "hpct: test drain x=1 [a]" and not n2.usable and not n2.lost
    assert (n3.state, n3.reason) == ("DOWN", "hpct: test down") and n3.lost
    for n in nodes:
        assert (n.addr == "127.0.0.1") if with_addr else n.addr is None


def test_sinfo_json(rec: Recorded) -> None:
    text = rec.text("sinfo.json")
    # 22.05 prints one record per node; from 23.02 on groups of nodes, without addresses
    assert sinfo_json_has_nodes(text) is (not rec.newer)
    _check_scene_nodes(parse_sinfo_json(text), with_addr=not rec.newer)


def test_scontrol_show_nodes_json(rec: Recorded) -> None:
    if not rec.newer:
        assert rec.rc("scontrol-show-nodes.json") != 0
        assert "unrecognized option '--json'" in rec.stderr("scontrol-show-nodes.json")
        return
    _check_scene_nodes(parse_scontrol_nodes_json(rec.text("scontrol-show-nodes.json")),
                       with_addr=True)


def test_scontrol_show_node_lines(rec: Recorded) -> None:
    lines = rec.text("scontrol-show-node.txt").splitlines()
    _check_scene_nodes([parse_node_record(line) for line in lines], with_addr=True)


def test_client_nodes_agree_with_scontrol_show_node(rec: Recorded) -> None:
    """nodes() reads the per-node JSON of each release, and says what show_node says."""
    calls: list[list[str]] = []
    client = SlurmClient(runner=rec.runner(calls))
    shown = {n.name: n for n in map(parse_node_record,
                                    rec.text("scontrol-show-node.txt").splitlines())}
    assert {n.name: n for n in client.nodes()} == shown
    assert {n.name: n for n in client.nodes()} == shown
    if rec.newer:  # the grouped sinfo is read once, then scontrol's per-node records
        assert calls == [["sinfo", "--json"], ["scontrol", "show", "nodes", "--json"],
                         ["scontrol", "show", "nodes", "--json"]]
    else:
        assert calls == [["sinfo", "--json"], ["sinfo", "--json"]]


def test_squeue_json(rec: Recorded) -> None:
    jobs = {j.job_id: j for j in parse_squeue_json(rec.text("squeue.json"))}
    running, pending = jobs[rec.running], jobs[rec.pending]
    assert (running.state, running.nodelist, running.batch_host) == ("RUNNING", ["n1"], "n1")
    assert (running.name, running.user, running.exit_code, running.exit_signal) == (
        "running", "root", 0, 0)
    assert not running.finished and running.restart_count == 0 and running.flags is not None
    assert (pending.state, pending.nodelist, pending.batch_host) == ("PENDING", [], None)
    assert pending.reason and not pending.finished
    if rec.failed in jobs:  # 22.05 lists finished jobs in --json; 24.11 and 26.05 do not
        failed = jobs[rec.failed]
        assert (failed.state, failed.exit_code, failed.exit_signal) == ("FAILED", 3, 0)
        assert failed.finished
    else:
        assert rec.newer


def test_client_jobs(rec: Recorded) -> None:
    client = SlurmClient(runner=rec.runner([]))
    assert [j.job_id for j in client.jobs(job_ids=[rec.running])] == [rec.running]
    assert {j.job_id for j in client.jobs() if not j.finished} == {rec.running, rec.pending}


def test_scontrol_show_job_lines(rec: Recorded) -> None:
    jobs = {j.job_id: j for j in map(parse_job_record,
                                     rec.text("scontrol-show-job.txt").splitlines())}
    assert jobs[rec.failed].state == "FAILED" and jobs[rec.failed].exit_code == 3
    assert jobs[rec.running].state == "RUNNING" and jobs[rec.running].nodelist == ["n1"]
    assert jobs[rec.pending].state == "PENDING" and jobs[rec.pending].nodelist == []


def test_the_small_reads(rec: Recorded) -> None:
    assert parse_sbatch_parsable(rec.text("sbatch-parsable.txt")) == rec.running
    assert parse_job_state(rec.text("squeue-state-running.txt")) == "RUNNING"
    assert parse_job_state(rec.text("squeue-state-failed.txt")) is None  # no longer listed
    assert [(s.step, s.nodelist) for s in parse_steps(rec.text("squeue-steps.txt"))] == [
        ("0", ["n1"]), ("batch", ["n1"])]
    assert parse_node_states(rec.text("sinfo-states.txt")) == {
        "n1": "mixed", "n2": "drained", "n3": "down"}
    [resv] = parse_reservations(rec.text("scontrol-show-reservation.txt"))
    assert resv.name == "hpct_rec" and resv.nodes == ["n1"] and resv.maintenance


def test_hostnames_with_text_after_the_bracket(rec: Recorded) -> None:
    """`n[1-2]-ib`: 22.05's scontrol refuses it (exit 0, "Invalid hostlist"), later ones
    expand it; hostlist.expand expands it as they do."""
    out = rec.text("show-hostnames-suffix.txt").split()
    if rec.newer:
        assert out == ["n1-ib", "n2-ib"]
    else:
        assert out == [] and "Invalid hostlist" in rec.stderr("show-hostnames-suffix.txt")
    assert expand("n[1-2]-ib") == ["n1-ib", "n2-ib"]


# ---- what no release printed: an error naming the command and the field, never [] ----------

def _doc(name: str, release: str = "24.11") -> dict:
    return json.loads((DATA / release / name).read_text())


@pytest.mark.parametrize("doc, match", [
    ({"meta": {}, "errors": [], "warnings": []},
     r"sinfo --json: neither field 'nodes' \(Slurm 22.05\) nor 'sinfo'"),
    ({"nodes": {"n1": {}}}, r"sinfo --json: neither field 'nodes'"),
    ({"nodes": [{"name": "n1"}]}, r"sinfo --json: field 'state' missing in node 'n1'"),
    ({"nodes": [{"name": "n1", "state": 3}]}, r"sinfo --json: field 'state' of node 'n1' is int"),
    ({"nodes": [{"name": "n1", "state": ["DRAIN"]}]}, r"does not hold exactly one of"),
    ({"sinfo": [{"node": {"state": ["IDLE"]}}]}, r"sinfo --json: field 'nodes' missing in sinfo\[0\]"),
])
def test_sinfo_json_that_cannot_be_read_raises(doc: dict, match: str) -> None:
    with pytest.raises(HpctError, match=match):
        parse_sinfo_json(json.dumps(doc))


def test_squeue_json_that_cannot_be_read_raises() -> None:
    doc = _doc("squeue.json")
    with pytest.raises(HpctError, match=r"squeue --json: field 'jobs' missing"):
        parse_squeue_json(json.dumps({"meta": {}, "errors": []}))
    for field, value, match in (
            ("job_state", 3, r"field 'job_state' of job 2 is int"),
            ("job_state", [], r"field 'job_state' of job 2 is empty"),
            ("exit_code", "x", r"field 'exit_code' of job 2 is str 'x', not a non-negative"),
            ("exit_code", {"return_code": {"set": True, "number": -1}},
             r"field 'exit_code.return_code' of job 2"),
            ("flags", "JOB_WAS_RUNNING", r"field 'flags' of job 2 is not a list"),
            ("nodes", ["n1"], r"field 'nodes' of job 2 is not a hostlist")):
        bad = json.loads(json.dumps(doc))
        bad["jobs"][0][field] = value
        with pytest.raises(HpctError, match=match):
            parse_squeue_json(json.dumps(bad))
    no_id = json.loads(json.dumps(doc))
    del no_id["jobs"][0]["job_id"]
    with pytest.raises(HpctError, match=r"field 'job_id' missing in jobs\[0\]"):
        parse_squeue_json(json.dumps(no_id))


def test_scontrol_nodes_json_that_cannot_be_read_raises() -> None:
    with pytest.raises(HpctError, match=r"scontrol show nodes --json: field 'nodes' missing"):
        parse_scontrol_nodes_json('{"meta": {}}')
    doc = _doc("scontrol-show-nodes.json")
    doc["nodes"][0]["features"] = {"a": 1}
    with pytest.raises(HpctError, match=r"field 'features' of node 'n1' is dict"):
        parse_scontrol_nodes_json(json.dumps(doc))
