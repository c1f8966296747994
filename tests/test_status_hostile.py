"""Issue 45.3: `hpct-slurm status` and `report` read a run dir that the job's user (and whatever
runs as that user) can write, maybe as root. A FIFO, a device, a link out of the run dir, a
huge file, malformed records and escape sequences in a node name: each is named in one line
and the rest of the run is still shown; nothing hangs, nothing is followed out, nothing reaches
the terminal raw."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hpct_slurm.errors import HpctError
from hpct_slurm.report.cli import _job_id_of, format_report, format_status, load_run, \
    resolve_run_dir
from hpct_slurm.report.model import build_report, build_status

FIXTURE = Path(__file__).parent / "data" / "report-run"   # n3 crashed, n5 took rank 2
HPCT = str(Path(sys.executable).parent / "hpct-slurm")
# A guard against a hang only (the old code blocked for ever on a FIFO): never a measure.
HANG_GUARD_S = 120


@pytest.fixture
def run(tmp_path: Path) -> Path:
    d = tmp_path / "hpct-2"
    shutil.copytree(FIXTURE, d)
    return d


def _status(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([HPCT, "status", str(run_dir), *extra], capture_output=True,
                          text=True, timeout=HANG_GUARD_S)


def _still_shows_the_run(out: str) -> None:
    assert "job 2 " in out and "n5-0" in out and "n3 replaced by n5" in out, out


def test_a_fifo_in_events_is_skipped_not_waited_on(run: Path) -> None:
    os.mkfifo(run / "events" / "n9-0.jsonl")   # nobody ever writes into it
    out = _status(run)
    assert out.returncode == 0, out.stderr
    assert "events/n9-0.jsonl is not a regular file (a FIFO): not read" in out.stderr
    _still_shows_the_run(out.stdout)


def test_a_link_to_dev_zero_is_not_followed(run: Path) -> None:
    os.symlink("/dev/zero", run / "events" / "n9-0.jsonl")
    out = _status(run)
    assert out.returncode == 0, out.stderr
    assert "events/n9-0.jsonl is a symbolic link: not followed, not read" in out.stderr
    _still_shows_the_run(out.stdout)


def test_a_link_to_a_file_outside_the_run_dir_is_never_read(run: Path, tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$SECRETHASH:19000:0:99999:7:::\n")
    os.symlink(secret, run / "events" / "n9-0.jsonl")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "n8-0.jsonl").write_text("root:$6$OTHERHASH:19000\n")
    shutil.move(str(run / "events"), str(tmp_path / "real-events"))
    os.symlink(elsewhere, run / "events")      # the whole events/ pointed elsewhere
    out = _status(run)
    assert out.returncode == 0, out.stderr
    assert "SECRETHASH" not in out.stdout + out.stderr
    assert "OTHERHASH" not in out.stdout + out.stderr
    assert "events/ is a symbolic link: not followed: no rank log read" in out.stderr
    shutil.rmtree(elsewhere)
    os.unlink(run / "events")
    shutil.move(str(tmp_path / "real-events"), str(run / "events"))
    os.symlink(secret, run / "controller.jsonl.real")
    os.replace(run / "controller.jsonl.real", run / "controller.jsonl")
    out = _status(run)
    assert out.returncode == 2 and "SECRETHASH" not in out.stdout + out.stderr
    assert "controller.jsonl is a symbolic link: not followed, not read" in out.stderr


def test_a_huge_log_is_read_only_at_its_ends(run: Path, monkeypatch) -> None:
    """Of a log over the cap only its first and last halves are read, at whole lines, and a
    warning says how much was left out; the records at either end are still there."""
    from hpct_slurm.report import files

    monkeypatch.setattr(files, "READ_CAP", 64 * 1024)
    lines = (run / "events" / "n1-0.jsonl").read_text().splitlines()
    head, tail = lines[:5], lines[-5:]
    filler = [json.dumps({"t": 1795318810.0, "event": "rank.replica_stored", "pad": "x" * 200})
              ] * 2000
    (run / "events" / "n1-0.jsonl").write_text("\n".join(head + filler + tail) + "\n")
    got = load_run(run)
    records = got.ranks["n1-0"]
    assert records[:5] == [json.loads(x) for x in head]
    assert records[-5:] == [json.loads(x) for x in tail]
    assert len(records) < 400  # the middle was never parsed
    (said,) = [w for w in got.warnings if "n1-0.jsonl is" in w]
    assert "over the 0 MiB read of a log: only its first and last 0 MiB were read" in said


def test_a_gigabyte_of_zeros_is_bounded_and_said(run: Path) -> None:
    with open(run / "events" / "n9-0.jsonl", "wb") as f:
        f.truncate(1 << 30)                    # sparse: costs no disk
    out = _status(run)
    assert out.returncode == 0, out.stderr
    assert "events/n9-0.jsonl is 1024 MiB, over the 64 MiB read of a log: only its first " \
           "and last 32 MiB were read" in out.stderr
    _still_shows_the_run(out.stdout)


def test_malformed_records_are_a_line_each_and_the_rest_is_shown(run: Path) -> None:
    with open(run / "controller.jsonl", "a") as f:
        f.write(json.dumps({"t": 1795318830.0, "event": "fault.detected", "node": ["n1", "n2"],
                            "reason": "x"}) + "\n")
        f.write(json.dumps({"t": 1795318831.0, "event": "generation.start",
                            "generation": "abc", "members": ["n1"], "restore_step": 3}) + "\n")
        f.write(json.dumps({"t": 1795318832.0, "event": "recovery.done", "generation": 9,
                            "recovery_s": 1.0, "lost": "n1", "reasons": {}, "phases": {}})
                + "\n")
    with open(run / "events" / "n1-0.jsonl", "a") as f:
        f.write('{"t": 1795318833.0, "event": "rank.step", "rank": 0, "generation": 0, '
                '"step": NaN}\n[1, 2]\n' + json.dumps({"t": True, "event": "rank.step"}) + "\n")
    for extra in ((), ("--json",)):
        out = _status(run, *extra)
        assert out.returncode == 0, out.stderr
        assert "Traceback" not in out.stderr
        warnings = [ln for ln in out.stderr.splitlines() if ln.startswith("HPCT warning:")]
        assert len(warnings) == 6, out.stderr
        for what in ("a fault.detected whose node is ['n1', 'n2'], not a string",
                     "a generation.start whose generation is 'abc', not an integer",
                     "a recovery.done whose lost is 'n1', not a list of strings",
                     "a rank.step whose step is nan, not an integer",
                     "line 79 ('[1, 2]'): not a JSON object but list",
                     "a rank.step without a time 't'"):
            assert any(what in w for w in warnings), (what, warnings)
    _still_shows_the_run(_status(run).stdout)
    rep = subprocess.run([HPCT, "report", str(run)], capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    assert rep.returncode == 0 and "n3->n5" in rep.stdout, rep.stderr


def test_escape_sequences_in_a_node_name_never_reach_the_terminal(run: Path) -> None:
    evil = "n3\x1b]0;owned\x07\x1b[2J\u202e"
    for path in [run / "controller.jsonl", *sorted((run / "events").glob("*.jsonl"))]:
        path.write_text(path.read_text().replace('"n3"', json.dumps(evil)))
    os.rename(run / "events" / "n3-0.jsonl", run / "events" / f"{evil}-0.jsonl")
    for cmd in ("status", "report"):
        out = subprocess.run([HPCT, cmd, str(run)], capture_output=True, text=True,
                             timeout=HANG_GUARD_S)
        assert out.returncode == 0, out.stderr
        assert not any(c in out.stdout + out.stderr for c in "\x1b\x07\u202e"), out.stdout
        assert "n3\\x1b]0;owned\\x07\\x1b[2J\\u202e" in out.stdout
    # --json escapes them itself, and says the name as it is
    out = _status(run, "--json")
    assert "\x1b" not in out.stdout
    assert any(f["node"] == evil for f in json.loads(out.stdout)["faults"])


def test_the_job_id_of_a_run_dir_is_read_without_waiting_on_a_fifo(run: Path) -> None:
    os.unlink(run / "controller.jsonl")
    os.mkfifo(run / "controller.jsonl")
    # in a process of its own: the old code blocked here for ever
    out = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                          "from hpct_slurm.report.cli import _job_id_of; "
                          "print(_job_id_of(Path(sys.argv[1])))", str(run)],
                         capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.stdout.strip() == "None", out.stderr


# ---- numbers: a record's number never crashes, nor prints hundreds of digits ------------------

LOGS = ["controller.jsonl", *(f"events/{p.name}" for p in sorted((FIXTURE / "events").iterdir()))]
_numbers = st.one_of(
    st.integers(4290, 6000).map(lambda n: "9" * n),          # int() refuses over 4,300 digits
    st.integers(20, 400).map(lambda n: "-" + "9" * n),
    st.sampled_from(["1e308", "-1e308", "1e400", "-1e400", "NaN", "Infinity", "-0.0", "1e10",
                     "9223372036854775808", "-9223372036854775809", "253402300800", "-1",
                     "0.5", "1" * 400 + ".5"]))


def _printed(run_dir: Path) -> tuple[dict[str, list[dict]], list[str]]:
    """The records `status` and `report` read of a run dir, and all they print (text and
    --json, warnings too), run in this process."""
    run = load_run(run_dir)
    st_, rep = build_status(run, time.time()), build_report(run)
    records = {"controller.jsonl": run.controller,
               **{f"events/{stem}.jsonl": evs for stem, evs in run.ranks.items()}}
    return records, [format_status(st_), json.dumps(st_.to_dict()), format_report(rep),
                     json.dumps(rep.to_dict(with_steps=True)), *run.warnings]


def _strict_json(text: str) -> None:
    def refuse(name: str):
        raise AssertionError(f"{name} in --json output")
    json.loads(text, parse_constant=refuse)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(LOGS), st.data(), _numbers)
def test_a_hostile_number_in_a_record_is_left_out_or_read_never_fatal(log: str, data,
                                                                      number: str) -> None:
    """One record of the run gets a hostile number in a field (its time, a field the report
    reads, or a new one). Either it is read, or it is left out with a warning naming its file
    and line; every other record is still read, and nothing printed holds a run of digits
    longer than the 60 characters a warning quotes of a line (1e308 printed was 300)."""
    lines = (FIXTURE / log).read_text().splitlines()
    lineno = data.draw(st.integers(1, len(lines)), label="line")
    rec = json.loads(lines[lineno - 1])
    field = data.draw(st.sampled_from(["t", *rec, "extra"]), label="field")
    lines[lineno - 1] = json.dumps({**rec, field: "HOLE"}).replace('"HOLE"', number)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "hpct-2"
        shutil.copytree(FIXTURE, run_dir)
        (run_dir / log).write_text("\n".join(lines) + "\n")
        before, _ = _printed(FIXTURE)
        try:
            records, printed = _printed(run_dir)
        except HpctError as exc:   # the run's only controller.start left out
            assert rec["event"] == "controller.start" and "has no controller.start" in str(exc)
            return
    for name, kept in records.items():
        assert len(kept) == len(before[name]) - (name == log and len(kept) < len(before[name]))
    if len(records[log]) < len(before[log]):
        assert any(f"{log} line {lineno} (" in w for w in printed[4:]), printed[4:]
    for out in printed:
        assert not re.search(r"[0-9]{61}", out), out[:300]
    _strict_json(printed[1])
    _strict_json(printed[3])


def test_a_controller_log_that_is_a_directory_is_named_not_missing(run: Path) -> None:
    os.unlink(run / "controller.jsonl")
    os.mkdir(run / "controller.jsonl")
    out = _status(run)
    assert out.returncode == 2
    assert "controller.jsonl is not a regular file (a directory): not read" in out.stderr


@pytest.mark.parametrize("job_id", ["1e400", '"\u0664\u0662"', "9" * 5000, "true"])
def test_the_job_id_of_a_run_dir_is_an_integer_read_as_records_are(run: Path,
                                                                    job_id: str) -> None:
    """1e400 read as a float is infinite (int() raised OverflowError); '٤٢' was job 42."""
    text = (run / "controller.jsonl").read_text()
    (run / "controller.jsonl").write_text(text.replace('"job_id": 2', f'"job_id": {job_id}', 1))
    assert _job_id_of(run) is None
    assert _job_id_of(FIXTURE) == 2


@pytest.mark.parametrize("target", ["\u0664\u0662", "9" * 5000])
def test_a_job_id_given_in_other_digits_or_too_long_is_refused(tmp_path: Path,
                                                               target: str) -> None:
    class NoSlurm:
        def show_job(self, job_id: int):
            raise AssertionError(f"asked Slurm about job {job_id}")

    with pytest.raises(HpctError, match="is neither an existing run dir nor a Slurm job id"):
        resolve_run_dir(target, client=NoSlurm(), cwd=tmp_path)
