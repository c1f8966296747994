"""Issue 45, item 2: an event log that cannot be written for want of a descriptor. Its record
raised into whatever wrote it, and ended the transfer server's accept thread, a store shard's
loop, the controller's watchdog. Now EventLog holds the record, says so on stderr (once per
30 s), and writes it, after a summary, with the next record it can."""
from __future__ import annotations

import json

import pytest

from _descriptors import out_of_descriptors
from hpct_slurm import events as E
from hpct_slurm.events import Ev, EventLog


def _records(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_records_out_of_descriptors_are_held_then_written_in_order(tmp_path, capsys):
    log = EventLog(tmp_path / "rank.jsonl", source="r0")
    log.emit(Ev.RANK_STEP, step=1)
    with out_of_descriptors():
        log.emit(Ev.RANK_STEP, step=2)  # no exception: held
        log.emit(Ev.RANK_STEP, step=3)
        assert log.held == 2 and not log.flush()
    assert "cannot be written: Too many open files (errno 24)" in capsys.readouterr().err
    assert [r.get("step") for r in _records(tmp_path / "rank.jsonl")] == [1]
    log.emit(Ev.RANK_STEP, step=4)
    records = _records(tmp_path / "rank.jsonl")
    assert [r["event"] for r in records] == ["rank.step"] * 3 + ["event_log.delayed",
                                                                 "rank.step"]
    assert [r.get("step") for r in records] == [1, 2, 3, None, 4]
    late = records[3]
    assert (late["written_late"], late["dropped"], late["source"]) == (2, 0, "r0")
    assert "errno 24" in late["error"] and log.held == 0


def test_past_the_hold_limit_records_are_counted_by_name_and_flush_writes_the_rest(
        tmp_path, monkeypatch):
    monkeypatch.setattr(E, "HOLD_MAX", 2)
    log = EventLog(tmp_path / "c.jsonl")
    with out_of_descriptors():
        for step in range(3):
            log.emit(Ev.RANK_STEP, step=step)
        log.emit(Ev.FAULT_DETECTED, node="n1")
    assert log.flush() and log.held == 0
    records = _records(tmp_path / "c.jsonl")
    assert [r.get("step") for r in records[:2]] == [0, 1]
    assert records[2]["event"] == "event_log.delayed"
    assert records[2]["dropped_events"] == {"rank.step": 1, "fault.detected": 1}
    assert records[2]["dropped"] == 2 and len(records) == 3


def test_a_log_that_refuses_us_for_another_reason_still_says_so(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "log.jsonl").mkdir()  # a directory where the log goes
    with pytest.raises(Exception, match="cannot be opened|not a regular file"):
        EventLog(tmp_path / "d" / "log.jsonl").emit(Ev.CONTROLLER_START)


def test_an_accept_loop_writes_what_was_held_at_the_first_accept_that_can(tmp_path):
    """The accept that ends a pause takes the descriptor just freed, so the held records may
    not be writable yet: the loop stays paused, and a later accept writes them (it wrote
    nothing more once one flush had failed: the accept_failed record was lost)."""
    from errno import EMFILE

    from hpct_slurm.accept_pause import AcceptPause

    log = EventLog(tmp_path / "server.jsonl")
    pause = AcceptPause(lambda **f: log.emit(Ev.CONTROLLER_ACCEPT_FAILED, **f), log)
    with out_of_descriptors():
        pause.failed(OSError(EMFILE, "Too many open files"))
        assert log.held == 1
        pause.accepted()  # accepting works, the log's file does not open yet
        assert pause.paused and log.held == 1
    pause.accepted()
    assert not pause.paused and log.held == 0
    records = _records(tmp_path / "server.jsonl")
    assert [r["event"] for r in records] == ["controller.accept_failed", "event_log.delayed"]
    assert "errno 24" in records[0]["error"]
