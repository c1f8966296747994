"""The Slurm parsers on output RECORDED from each Slurm release this project was run against
(tests/data/slurm/<release>/, made by scripts/record-slurm-output.sh on a 3-node local cluster:
a failed job, a running job with a step on n1, n2 drained, n3 down, a pending job, a MAINT
reservation). The same scene on every release, so one set of expectations; and a read that
cannot be understood raises an HpctError naming the command and the field, never [].
All offline: the client's `runner` answers from the recordings."""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hpct_slurm.errors import HpctError
from hpct_slurm.slurm.client import (
    BASE_JOB_STATES, BASE_NODE_STATES, JOB_STATE_FLAGS, JobInfo, NodeInfo, SlurmClient,
    parse_job_record, parse_job_state, parse_node_record, parse_node_states, parse_reservations,
    parse_sbatch_parsable, parse_scontrol_nodes_json, parse_sinfo_json, parse_squeue_json,
    parse_steps, parse_version, sinfo_json_has_nodes)
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
            ("exit_code", "x", r"field 'exit_code' of job 2 'x' is not a non-negative"),
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



# ---- the recordings mutated: the right answer or an HpctError, never another exception ------
# The controller's Slurm calls catch HpctError only: any other exception of a parser ends it.

UINT32_MAX = 0xFFFFFFFF
JSON_READS = [(r, name, command, parse) for r in RELEASES for name, command, parse in (
    ("sinfo.json", "sinfo --json", parse_sinfo_json),
    ("squeue.json", "squeue --json", parse_squeue_json),
    ("scontrol-show-nodes.json", "scontrol show nodes --json", parse_scontrol_nodes_json))
    if not (DATA / r / f"{name}.rc").exists()]


def _each_line(parse):
    return lambda text: [parse(line) for line in text.splitlines()]


TEXT_READS = [(r, name, parse) for r in RELEASES for name, parse in (
    ("scontrol-show-job.txt", _each_line(parse_job_record)),
    ("scontrol-show-node.txt", _each_line(parse_node_record)),
    ("squeue-state-running.txt", parse_job_state), ("squeue-steps.txt", parse_steps),
    ("sinfo-states.txt", parse_node_states),
    ("scontrol-show-reservation.txt", parse_reservations),
    ("sbatch-parsable.txt", parse_sbatch_parsable), ("version.txt", parse_version))]
# Digits that str.isdecimal, \\d and int() take besides 0-9: Arabic-Indic, fullwidth, Devanagari.
OTHER_DIGITS = "٤٢０１२३"
_hostile_text = st.one_of(
    st.sampled_from(["", " ", "WEIRD", "running", "ıdle", "(null)", "-1", "1e3", "4294967296"]),
    st.integers(4290, 4310).map(lambda n: "9" * n),   # about int()'s limit of 4,300 digits
    st.text(alphabet=OTHER_DIGITS, min_size=1, max_size=3),
    st.text(alphabet="0129" + OTHER_DIGITS + "_.:;+ ", max_size=8))
_hostile_json = st.one_of(
    _hostile_text, st.none(), st.booleans(),
    st.sampled_from([0, 7, -1, UINT32_MAX + 1, 2 ** 64, 1.5, 1e308, float("nan"), {}, [],
                     {"a": 1}, ["RUNNING", 3], [{"a": 1}], {"set": "yes", "number": 5},
                     {"set": True, "infinite": False, "number": "٤٢"}]))


def _paths(doc, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON document: each object, list and value below its top."""
    children = doc.items() if isinstance(doc, dict) else \
        enumerate(doc) if isinstance(doc, list) else ()
    found = []
    for key, child in children:
        found += [(*at, key), *_paths(child, (*at, key))]
    return found


def _put(doc, path: tuple, value):
    """A copy of `doc` with `value` at `path`."""
    doc = json.loads(json.dumps(doc))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


def _answers(records: list) -> set[tuple[str, object]]:
    """Every (field, value) pair of a parse's records (lists as tuples, to be hashable)."""
    return {(f.name, tuple(v) if isinstance(v, list) else v)
            for r in records for f in fields(r) for v in [getattr(r, f.name)]}


def _read_from(value, got) -> bool:
    """Whether `got`, an answer the recording itself does not give, can be `value` read right:
    a number only from an integer or from its ASCII digits in a text, text only from text,
    nothing (None, an empty list, 0) from null."""
    if value is None:
        return not got
    if isinstance(got, int):
        return isinstance(value, str) and str(got) in value \
            or isinstance(value, int) and not isinstance(value, bool)
    return all(isinstance(v, str) for v in (value if isinstance(value, list) else [value]))


def _well_formed(rec) -> None:
    """What holds of every record whatever it was read from: a state Slurm has, and numbers
    Slurm's types can hold."""
    if isinstance(rec, JobInfo):
        assert rec.state in BASE_JOB_STATES | JOB_STATE_FLAGS, rec.state
        assert 1 <= rec.job_id <= UINT32_MAX
        assert all(0 <= n <= UINT32_MAX
                   for n in (rec.restart_count, rec.exit_code, rec.exit_signal))
    if isinstance(rec, NodeInfo):
        assert rec.state in BASE_NODE_STATES, rec.state


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(JSON_READS), st.data(), _hostile_json)
def test_mutated_json_is_read_right_or_refused(read, data, value) -> None:
    release, name, _, parse = read
    doc = _doc(name, release)
    # half the time among the records the parser reads: it never reads `meta`
    path = data.draw(st.sampled_from([p for p in _paths(doc) if p[0] != "meta"])
                     | st.sampled_from(_paths(doc)), label="path")
    try:
        got = parse(json.dumps(_put(doc, path, value)))
    except HpctError:
        return
    for rec in got:
        _well_formed(rec)
    for field, answer in _answers(got) - _answers(parse(json.dumps(doc))):
        assert _read_from(value, answer), (field, answer, value)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(JSON_READS), st.data(), st.sampled_from([3, 2000, 100_000]),
       st.integers(4290, 5000))
def test_json_nested_deep_or_with_a_long_number_is_refused(read, data, depth: int,
                                                           digits: int) -> None:
    """Python's JSON reader raises RecursionError past about 1,000 levels and ValueError on an
    integer over 4,300 digits: here an HpctError naming the command, or (lists nested a few
    levels in a field never read) the recording's own answer."""
    release, name, command, parse = read
    doc = _doc(name, release)
    text = json.dumps(_put(doc, data.draw(st.sampled_from(_paths(doc)), label="path"), "HOLE"))
    for literal in ("[" * depth + "]" * depth, "9" * digits):
        try:
            got = parse(text.replace('"HOLE"', literal))
        except HpctError as exc:
            assert exc.message.startswith(f"{command}"), exc
            continue
        assert got == parse(json.dumps(doc))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXT_READS), st.data(), _hostile_text)
def test_mutated_text_is_read_right_or_refused(read, data, value: str) -> None:
    """A word of what scontrol, squeue, sinfo or sbatch printed replaced: a number is read only
    from ASCII digits, a job state only from a word Slurm prints."""
    release, name, parse = read
    text = (DATA / release / name).read_text()
    word = data.draw(st.sampled_from(list(re.finditer(r"[A-Za-z0-9_]+", text))), label="word")
    try:
        got = parse(text[:word.start()] + value + text[word.end():])
    except HpctError:
        return
    before = parse(text)
    if isinstance(got, list):
        for rec in got:
            _well_formed(rec)
        for field, answer in _answers(got) - _answers(before):
            assert not isinstance(answer, int) or _read_from(value, answer), (field, answer)
    elif name == "squeue-state-running.txt":
        assert got is None or got in BASE_JOB_STATES | JOB_STATE_FLAGS, got
    elif name == "sbatch-parsable.txt" and got != before:
        assert _read_from(value, got) and 1 <= got <= UINT32_MAX, got
    elif name == "version.txt":
        assert got.isascii(), got


_JOB_LINE = (DATA / "24.11" / "scontrol-show-job.txt").read_text().splitlines()[1]


def _squeue_with(**fields) -> str:
    doc = _doc("squeue.json")
    doc["jobs"][0].update(fields)
    return json.dumps(doc)


@pytest.mark.parametrize("parse, text, match", [
    (parse_squeue_json, "[" * 100_000 + "]" * 100_000,
     r"^HPCT: squeue --json output is nested deeper than Python's JSON reader goes"),
    (parse_squeue_json, _squeue_with(job_id=2).replace('"job_id": 2', '"job_id": ' + "9" * 5000),
     r"^HPCT: squeue --json output holds an integer of 5000 digits \(9{20}\.\.\.\)"),
    (parse_squeue_json, _squeue_with(job_id="9" * 4300),
     r"^HPCT: squeue --json: field 'job_id' of jobs\[0\] '9+'\.\.\. \(4300 characters\) "
     r"is not a non-negative integer"),
    (parse_squeue_json, _squeue_with(job_id="٤٢"),
     r"^HPCT: squeue --json: field 'job_id' of jobs\[0\] '٤٢' is not a non-negative integer"),
    (parse_squeue_json, _squeue_with(job_state=["WEIRD"]),
     r"^HPCT: squeue --json: field 'job_state' of job 2 'WEIRD' is not a job state Slurm "
     r"prints"),
    (parse_squeue_json, _squeue_with(user_name={"uid": 0}),
     r"^HPCT: squeue --json: field 'user_name' of job 2 is dict \"\{'uid': 0\}\", not text"),
    (parse_job_record, _JOB_LINE.replace("JobState=RUNNING", "JobState="),
     r"^HPCT: scontrol show job: field 'JobState' '' is not a job state Slurm prints"),
    (parse_job_record, _JOB_LINE.replace("JobId=2 ", f"JobId={'9' * 4300} "),
     r"^HPCT: scontrol show job: field 'JobId' '9+'\.\.\. \(4300 characters\) is not a "
     r"Slurm job id"),
    (parse_job_record, _JOB_LINE.replace("JobId=2 ", "JobId=٤٢ "),
     r"^HPCT: scontrol show job: field 'JobId' '٤٢' is not a Slurm job id"),
    (parse_job_state, "WEIRD\n",
     r"^HPCT: squeue -o %T: state 'WEIRD' is not a job state Slurm prints"),
])
def test_what_the_review_found_is_refused_naming_command_and_field(parse, text: str,
                                                                   match: str) -> None:
    with pytest.raises(HpctError, match=match):
        parse(text)



def _line(n: int):
    return lambda text: text.splitlines(keepends=True)[n]


# What the controller and the spare pool ask the client, and the recording that answers it.
CLIENT_READS = [
    (lambda c: c.nodes(), "sinfo.json", str), (lambda c: c.jobs(), "squeue.json", str),
    (lambda c: c.show_job(2), "scontrol-show-job.txt", _line(1)),
    (lambda c: c.show_node("n1"), "scontrol-show-node.txt", _line(0)),
    (lambda c: c.job_finished(2), "squeue-state-running.txt", str),
    (lambda c: c.job_steps(2), "squeue-steps.txt", str),
    (lambda c: c.reservations(), "scontrol-show-reservation.txt", str)]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(RELEASES), st.sampled_from(CLIENT_READS), st.data(),
       _hostile_text | st.integers(1000, 5000).map(lambda n: "[" * n + "]" * n))
def test_the_clients_reads_raise_only_hpct_error(release: str, read, data, value: str) -> None:
    """The controller's Slurm calls catch HpctError only: whatever Slurm printed, a read of
    the client answers or raises one. A word of the recording is replaced, half the time a
    number or a state (what the parsers convert)."""
    ask, name, part = read
    text = part((DATA / release / name).read_text())
    words = list(re.finditer(r"[A-Za-z0-9_]+", text))
    word = data.draw(st.sampled_from(words) | st.sampled_from(
        [w for w in words if w.group().isdigit() or w.group().isupper()]), label="word")
    printed = text[:word.start()] + value + text[word.end():]
    client = SlurmClient(runner=lambda argv, **kw: subprocess.CompletedProcess(argv, 0, printed,
                                                                               ""))
    try:
        ask(client)
    except HpctError:
        pass
