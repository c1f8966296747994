"""Pure: which records of a run's event logs `status` and `report` can read (issue 45.3).

The logs sit in a directory that the job's user, and whatever runs as that user, can write:
a record is input, not a promise. Each field that report/model.py reads is checked here for
the type it needs (a node is a string, a generation an integer, ...), and a record that fails
is left out with one line saying which and why, so that one bad record never hides the rest
of the run (nor ends in a traceback). Numbers are bounded too: what is printed of a record stays
short, and a time stays one the clock can show.
"""
from __future__ import annotations

import functools
import json
import math
from typing import Any

from ..events import Ev

# How a field must look: an integer (never a bool), a number, a string, a list of strings, an
# object of strings, an object of numbers.
INT, NUM, STR, STRS, STRMAP, NUMMAP = "an integer", "a number from -1e9 to 1e9", "a string", \
    "a list of strings", "an object of strings", "an object of numbers"
# A record's time `t`: Unix seconds from 1970 to the end of 9999, the years a clock shows in
# four digits (time.localtime raised OverflowError on -1e308, and printed times and their
# differences stay short).
TIME, TIME_MAX = "a Unix time from 1970 to 9999", 253402300799.0
# Every number report/model.py reads of a record, other than a time, is a duration in seconds
# or a ratio: none comes near 1e9 (32 years), and a bound keeps each one printed short.
NUM_MAX = 1e9
# hpct-slurm writes no integer beyond 64 bits: a longer one in a line is refused as the line is
# parsed (int() takes time that grows with the square of the digits, and raises ValueError over
# 4,300 of them), wherever it stands in the record.
INT_MIN, INT_MAX = -2 ** 63, 2 ** 63 - 1

# event -> {field: (kind, required)}: the fields report/model.py reads of it.
FIELDS: dict[str, dict[str, tuple[str, bool]]] = {
    Ev.CONTROLLER_START: {"job_id": (INT, False), "active": (STRS, False),
                          "spares": (STRS, False)},
    Ev.STEP_LAUNCH: {"node": (STR, True), "role": (STR, False)},
    Ev.GENERATION_START: {"generation": (INT, True), "members": (STRS, True),
                          "restore_step": (INT, True)},
    Ev.FAULT_DETECTED: {"node": (STR, True), "reason": (STR, False),
                        "generation": (INT, False), "role": (STR, False)},
    Ev.FAULT_FENCED: {"node": (STR, True), "how": (STR, False)},
    Ev.FAULT_STOP_SENT: {"generation": (INT, False)},
    Ev.FAULT_SECOND: {"nodes": (STRS, False)},
    Ev.RECOVERY_ASSIGN: {"generation": (INT, True), "restore_step": (INT, True),
                         "taken": (STRMAP, False), "sources": (STRMAP, False)},
    Ev.MOVE_ASSIGN: {"taken": (STRMAP, False)},
    Ev.RECOVERY_DONE: {"generation": (INT, True), "recovery_s": (NUM, True),
                       "lost": (STRS, True), "reasons": (STRMAP, True),
                       "phases": (NUMMAP, True)},
    Ev.RECOVERY_FAILED: {"reason": (STR, False), "error": (STR, False)},
    Ev.ESCALATE_REQUEUE: {"reason": (STR, False)},
    Ev.ESCALATE_FAIL: {"reason": (STR, False)},
    Ev.JOB_FAILED: {"cause": (STR, False), "reason": (STR, False)},
    Ev.CONTROLLER_EXIT: {"code": (INT, False)},
    Ev.RANK_STEP: {"rank": (INT, True), "generation": (INT, True), "step": (INT, True)},
    Ev.RANK_ADOPTED: {"rank": (INT, True), "generation": (INT, True), "reform_s": (NUM, True),
                      "restore_s": (NUM, True), "source": (STR, False)},
    Ev.RANK_FAULT: {"generation": (INT, True)},
    Ev.RANK_READY: {"teardown_s": (NUM, False)},
    Ev.NODE_SLOW: {"node": (STR, True), "ratio": (NUM, True), "window": (INT, True),
                   "step": (INT, False), "action": (STR, False)},
    Ev.NODE_CORRUPT: {"node": (STR, True), "action": (STR, False)},
}


def _is(kind: str, v: Any) -> bool:
    if kind == INT:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind in (NUM, TIME):
        low, high = (-NUM_MAX, NUM_MAX) if kind == NUM else (0.0, TIME_MAX)
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
            and low <= v <= high
    if kind == STR:
        return isinstance(v, str)
    if kind == STRS:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    if kind == STRMAP:
        return isinstance(v, dict) and all(isinstance(x, str) for x in v.values())
    return isinstance(v, dict) and all(_is(NUM, x) for x in v.values())  # NUMMAP


def problem(rec: Any) -> str | None:
    """Why `rec` cannot be read as an event record (None: it can)."""
    if not isinstance(rec, dict):
        return f"not a JSON object but {type(rec).__name__}"
    event = rec.get("event")
    if not isinstance(event, str):
        return "no 'event' name"
    if not isinstance(rec.get("t"), (int, float)) or isinstance(rec["t"], bool):
        return f"a {event} without a time 't'"
    if not _is(TIME, rec["t"]):
        return f"a {event} whose time 't' is {_show(rec['t'])}, not {TIME}"
    for name, (kind, required) in _fields(event).items():
        if name not in rec:
            if required:
                return f"a {event} without {name} (written by another version of hpct-slurm?)"
        elif not _is(kind, rec[name]):
            return f"a {event} whose {name} is {_show(rec[name])}, not {kind}"
    return None


@functools.lru_cache(maxsize=256)
def _fields(event: str) -> dict[str, tuple[str, bool]]:
    fields = dict(FIELDS.get(event, {}))
    if event.startswith("rank."):
        fields.setdefault("rank", (INT, False))  # a rank's own reports carry its rank
    return fields


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# At most so many records of one file are named one by one; the rest are counted.
WARNINGS_PER_FILE = 10


class _Unreadable:
    """A line that cannot be parsed, and why."""

    def __init__(self, why: str):
        self.why = why


class _LongInteger(Exception):
    """An integer literal beyond INT_MIN..INT_MAX in a line."""


def _integer(literal: str) -> int:
    """json's parse_int for a log line: the integer, if it fits 64 bits (int() is never asked
    to read more than 19 digits)."""
    digits = len(literal.lstrip("-"))
    value = int(literal) if digits <= len(str(INT_MAX)) else None
    if value is None or not INT_MIN <= value <= INT_MAX:
        raise _LongInteger(f"an integer of {digits} digits ({literal[:20]}"
                           f"{'...' if len(literal) > 20 else ''}), beyond 64 bits")
    return value


def readable(records: list[Any], where: str,
             labels: list[str] | None = None) -> tuple[list[dict], list[str]]:
    """The records that can be read, and a warning line for each one that cannot (named by
    its label, such as `line 7`, or by its time)."""
    kept: list[dict] = []
    said: list[str] = []
    for i, rec in enumerate(records):
        why = rec.why if isinstance(rec, _Unreadable) else problem(rec)
        if why is None:
            kept.append(rec)
        elif len(said) < WARNINGS_PER_FILE:
            label = labels[i] if labels else f"t={rec['t']}" if isinstance(rec, dict) \
                and _is(TIME, rec.get("t")) else f"record {i + 1}"
            said.append(f"{where} {label}: {why}: left out")
    skipped = len(records) - len(kept)
    if skipped > len(said):
        said.append(f"{where}: {skipped - len(said)} more record(s) that cannot be read: "
                    f"left out")
    return kept, said


def parse_jsonl(text: str, where: str) -> tuple[list[dict], list[str]]:
    """The records of one JSON-lines file that can be read, and warning lines for those that
    cannot (`readable`), naming the line.

    A writer killed mid-line (a crashed node) leaves a torn last line: it is said as such. Any
    other bad line (not JSON, a field of the wrong type: written by something other than
    hpct-slurm, or by another version; an integer beyond 64 bits) is left out, and the rest is
    read."""
    lines = [(i, ln) for i, ln in enumerate(text.split("\n"), 1) if ln.strip()]
    torn = []
    records, labels = [], []
    for pos, (lineno, line) in enumerate(lines):
        try:
            rec = json.loads(line, parse_int=_integer)
        except _LongInteger as exc:
            rec = _Unreadable(str(exc))
        except (json.JSONDecodeError, RecursionError):
            rec = _Unreadable("not JSON")
            if pos == len(lines) - 1:
                torn = [f"{where}: last line {lineno} is torn, ignored: {line[:60]!r}"]
                continue
        records.append(rec)
        labels.append(f"line {lineno} ({line[:60]!r})")
    kept, said = readable(records, where, labels)
    return kept, said + torn
