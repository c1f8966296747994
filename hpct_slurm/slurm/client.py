"""Slurm through its commands: `scontrol`, `sinfo`, `squeue`, `sbatch`, `srun`, `scancel`.

This is the one door to Slurm: no module outside `hpct_slurm/slurm/` builds a Slurm command
line (tests/test_slurm_door.py checks). Every command is an argv list (never a shell string),
run with a timeout through the client's `runner` (subprocess.run; tests inject a stand-in); a
failure raises SlurmCommandError carrying the argv, the exit code and Slurm's own message.
Output parsing is pure (the `parse_*` functions) and tested on outputs recorded from each Slurm
release it was run on (tests/data/slurm/<release>/, tests/test_slurm_recorded.py): a field that
reads as none of them raises an HpctError naming the command and the field, never an empty list.

Two Slurm habits shape this module:
* `scontrol show hostnames` exits 0 on a bad hostlist (it only prints "Invalid hostlist"), so
  success is judged from the output too.
* `scontrol show node -o` writes free text (Reason, Comment, Extra) unquoted at the end of the
  line; `Reason=` is therefore cut at its trailing `[user@time]` stamp, not at the next space.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..errors import HpctError, shown
from .env import check_job_id, check_uint
from .hostlist import compress, expand

BASE_NODE_STATES = frozenset(
    {"IDLE", "ALLOCATED", "MIXED", "DOWN", "ERROR", "FUTURE", "UNKNOWN"})
# States `scontrol update NodeName=... State=` accepts that this project has a use for.
UPDATE_NODE_STATES = frozenset({"DOWN", "DRAIN", "FAIL", "RESUME", "UNDRAIN"})
_STATES_NEEDING_REASON = frozenset({"DOWN", "DRAIN", "FAIL"})
# The one set of end states: a job in one of these (or gone from slurmctld) is finished.
FINISHED_JOB_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
    "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"})
# The words squeue's %T and scontrol's JobState print in place of the base state while one of
# these flags is set (Slurm's job_state_codes.html); squeue --json lists them after it.
JOB_STATE_FLAGS = frozenset({
    "COMPLETING", "CONFIGURING", "EXPEDITING", "LAUNCH_FAILED", "POWER_UP_NODE",
    "RECONFIG_FAIL", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "RESV_DEL_HOLD",
    "REVOKED", "SIGNALING", "SPECIAL_EXIT", "STAGE_OUT", "STOPPED", "UPDATE_DB"})
# Slurm's integers are 64 bits at most (20 digits): a JSON integer longer than this is not
# Slurm's, and is refused before int() reads it (whose cost grows with the square of the
# length, and which raises ValueError over 4,300 digits).
JSON_INT_DIGITS = 20
# The client commands this module runs (localcluster checks they are installed).
COMMANDS = ("sbatch", "squeue", "sinfo", "scontrol", "srun", "scancel")

_KEY_RE = re.compile(r"(?:^| )([A-Za-z][A-Za-z0-9_:/.]*)=")
_NODE_TEXT_TAIL_RE = re.compile(
    r" Reason=(?P<reason>.*?)(?: \[(?P<by>[^\]\s@]*)@(?P<at>[^\]\s]*)\])?"
    r"(?= Comment=| Extra=|$)")
_NODE_COMMENT_RE = re.compile(r" Comment=(?P<comment>.*?)(?= Extra=|$)")
_RESERVATION_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_NULLS = {"", "(null)", "N/A", "None"}
# Slurm 22.05 holds a requeued batch job back once its old run has finished completing: it
# moves the job's BeginTime to now + the credential lifetime (AuthInfo cred_expire, 120 s by
# default), unless that BeginTime is still ahead then (slurmctld/job_mgr.c,
# batch_requeue_fini). From the requeue on the job is PENDING (and COMPLETING), and its owner
# may set its StartTime: one this far after the requeue, past the old run's completion, makes
# it eligible then. (StartTime=now would not do: it is in the past when the completion ends.)
# An old run that takes longer to complete (a process that waits out KillWait) falls back to
# Slurm's hold.
REQUEUE_BEGIN_S = 10
REQUEUE_BEGIN_TRIES = 3
# slurmctld refuses a job update while the job's accounting record is being made: "Job update
# not available right now, the DB index is being set, try again in a bit" (after waiting 5 s
# for the index itself). Asking again later can work; any other refusal will not get better.
REFUSED_FOR_NOW = "try again"


class SlurmCommandError(HpctError):
    """A Slurm command failed; `argv`, `returncode` (None: it never finished) and `stderr`."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str, what: str = ""):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        detail = what or (lines[-1].strip() if lines else "no message")
        status = "timed out" if returncode is None else f"exit {returncode}"
        super().__init__(f"{' '.join(self.argv)} failed ({status}): {detail}")


@dataclass(frozen=True)
class NodeInfo:
    """One node as Slurm sees it. `state` is the base state (IDLE, ALLOCATED, MIXED, DOWN,
    ERROR, FUTURE, UNKNOWN); DRAIN, NOT_RESPONDING, COMPLETING, ... are in `flags`."""

    name: str
    state: str
    flags: frozenset[str]
    reason: str | None
    addr: str | None
    hostname: str | None
    features: tuple[str, ...]
    active_features: tuple[str, ...]
    comment: str | None = None  # the node's Comment (free text; the spare pool's records)

    @property
    def summary(self) -> str:
        """The word sinfo would use: DRAINING while jobs still run on a draining node,
        DRAINED once it is empty, else the base state."""
        if "DRAIN" in self.flags:
            return "DRAINING" if self.state in ("ALLOCATED", "MIXED") else "DRAINED"
        return self.state

    @property
    def lost(self) -> bool:
        """Slurm no longer hears from the node, or has marked it down."""
        return self.state == "DOWN" or "NOT_RESPONDING" in self.flags

    @property
    def usable(self) -> bool:
        """It can take new work now."""
        return (self.state in ("IDLE", "MIXED", "ALLOCATED")
                and not self.flags & {"DRAIN", "NOT_RESPONDING", "FAIL", "MAINTENANCE",
                                      "POWERED_DOWN", "POWERING_DOWN", "REBOOT_REQUESTED"})


@dataclass(frozen=True)
class JobInfo:
    """One job. `flags` is None where the source does not report them (scontrol)."""

    job_id: int
    name: str | None
    user: str | None
    state: str
    nodelist: list[str]
    batch_host: str | None
    restart_count: int
    reason: str | None
    exit_code: int
    exit_signal: int
    flags: frozenset[str] | None
    work_dir: str | None = None  # the job's WorkDir (its --chdir, else where it was submitted)
    comment: str | None = None  # its Comment (scontrol only): the lifecycle's summary
    end_time: str | None = None  # its EndTime (scontrol only; the time limit while it runs)

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_JOB_STATES


@dataclass(frozen=True)
class StepInfo:
    """One step of a job, from `squeue -s`: `step` is its number, or `batch`, `extern`, ..."""

    job_id: int
    step: str
    nodelist: list[str]

    @property
    def numbered(self) -> bool:
        """A step started by srun (not the batch shell or the extern step)."""
        return self.step.isdecimal()


# ---- pure parsing ------------------------------------------------------------------------

def parse_node_state(text: str) -> tuple[str, frozenset[str]]:
    """`IDLE+DRAIN` -> ("IDLE", {"DRAIN"}). Unknown words stay flags, so new Slurm flags
    never break parsing; a missing base state does. Slurm's words are ASCII: upper() would
    make others into one of them ('ıdle' into IDLE)."""
    words = [w for w in text.strip().upper().split("+") if w]
    if not text.isascii() or not words or words[0] not in BASE_NODE_STATES:
        raise HpctError(f"node state {text!r} does not start with one of "
                        f"{', '.join(sorted(BASE_NODE_STATES))}")
    return words[0], frozenset(words[1:])


def parse_scontrol_record(line: str) -> dict[str, str]:
    """`Key=value Key2=a b Key3=...` -> dict. A value runs until the next ` Key=`."""
    matches = list(_KEY_RE.finditer(line))
    if not matches or matches[0].start() != 0:
        raise HpctError(f"scontrol output {line[:80]!r} is not a Key=value record")
    record = {}
    for m, nxt in zip(matches, matches[1:] + [None]):
        end = nxt.start() if nxt else len(line)
        record[m.group(1)] = line[m.end():end].strip()
    return record


def _opt(value: str | None) -> str | None:
    if value is None:
        return None
    text = value.strip()
    return None if text in _NULLS else text


def _text(record: dict, key: str, what: str, where: str) -> str | None:
    """An optional text field: absent, null or one of Slurm's null words is None; anything but
    a string is an HpctError naming the field (never its repr read as the text)."""
    value = record.get(key)
    if value is not None and not isinstance(value, str):
        raise HpctError(f"{what}: field {key!r} of {where} is {type(value).__name__} "
                        f"{shown(str(value))}, not text")
    return _opt(value)


def _features(value: str | None) -> tuple[str, ...]:
    text = _opt(value)
    return tuple(f for f in text.split(",") if f) if text else ()


def parse_node_record(line: str) -> NodeInfo:
    """One line of `scontrol show node -o`."""
    line = line.rstrip("\n")
    reason = None
    tail = _NODE_TEXT_TAIL_RE.search(line)
    if tail:
        reason = _opt(tail.group("reason"))
        rest, line = line[tail.end():], line[:tail.start()]
    else:
        rest = line
    found = _NODE_COMMENT_RE.search(rest)
    comment = _opt(found.group("comment")) if found else None
    if found and not tail:
        line = line[:found.start()]
    rec = parse_scontrol_record(line)
    if "NodeName" not in rec or "State" not in rec:
        raise HpctError(f"scontrol node record {line[:80]!r} lacks NodeName or State")
    state, flags = parse_node_state(rec["State"])
    return NodeInfo(name=rec["NodeName"], state=state, flags=flags, reason=reason,
                    addr=_opt(rec.get("NodeAddr")), hostname=_opt(rec.get("NodeHostName")),
                    features=_features(rec.get("AvailableFeatures")),
                    active_features=_features(rec.get("ActiveFeatures")), comment=comment)


def _json_doc(text: str, what: str) -> dict:
    def integer(literal: str) -> int:
        if len(literal.lstrip("-")) > JSON_INT_DIGITS:
            raise HpctError(f"{what} output holds an integer of {len(literal.lstrip('-'))} "
                            f"digits ({literal[:20]}...): longer than any Slurm prints")
        return int(literal)

    try:
        doc = json.loads(text, parse_int=integer)
    except RecursionError:
        raise HpctError(f"{what} output is nested deeper than Python's JSON reader goes: not "
                        f"what Slurm prints: {text[:80]!r}") from None
    except ValueError as exc:
        raise HpctError(f"{what} output is not JSON ({exc}): {text[:80]!r}") from None
    if not isinstance(doc, dict):
        raise HpctError(f"{what} output is not a JSON object: {text[:80]!r}")
    errors = doc.get("errors") or []
    if errors:
        raise HpctError(f"{what} reported errors: {errors}")
    return doc


def _field(record: Any, key: str, what: str, kinds: type | tuple[type, ...],
           where: str = "") -> Any:
    """`record[key]`, which must be of `kinds`; else an HpctError naming the command (`what`)
    and the field (`where` says which record it is in)."""
    if not isinstance(record, dict):
        raise HpctError(f"{what}: {where or 'a record'} is {type(record).__name__}, "
                        f"not a JSON object")
    if key not in record:
        raise HpctError(f"{what}: field {key!r} missing{' in ' + where if where else ''} "
                        f"(fields: {', '.join(sorted(record))[:200]})")
    value = record[key]
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, allowed) or isinstance(value, bool) and bool not in allowed:
        raise HpctError(f"{what}: field {key!r}{' of ' + where if where else ''} is "
                        f"{type(value).__name__} {str(value)[:60]!r}, not what this "
                        f"release was read as")
    return value


def _list_of(record: dict, key: str, what: str, where: str) -> list:
    return _field(record, key, what, list, where)


def _words(value: Any, what: str, key: str, where: str) -> list[str]:
    """A state or flag set: `"idle"` (22.05) or `["IDLE", "DRAIN"]` (23.02 on). ASCII words
    only, as in parse_node_state."""
    if isinstance(value, str) and value.isascii():
        return [w for w in value.upper().replace("+", " ").split() if w]
    if isinstance(value, list) and all(isinstance(w, str) and w.isascii() for w in value):
        return [w.upper() for w in value if w]
    raise HpctError(f"{what}: field {key!r} of {where} is {type(value).__name__} "
                    f"{str(value)[:60]!r}, not a state word or a list of them")


def _node_state_of(words: list[str], what: str, where: str) -> tuple[str, frozenset[str]]:
    """The base state among `words` (exactly one) and the rest as flags."""
    bases = [w for w in words if w in BASE_NODE_STATES]
    if len(bases) != 1:
        raise HpctError(f"{what}: node state {words!r} of {where} does not hold exactly one of "
                        f"{', '.join(sorted(BASE_NODE_STATES))}")
    return bases[0], frozenset(w for w in words if w != bases[0])


def _text_list(value: Any, what: str, key: str, where: str) -> tuple[str, ...]:
    """Features: `"a,b"` (22.05, sinfo 24.11) or `["a", "b"]` (scontrol --json)."""
    if value is None or isinstance(value, str):
        return _features(value)
    if isinstance(value, list) and all(isinstance(f, str) for f in value):
        return tuple(f for f in value if f)
    raise HpctError(f"{what}: field {key!r} of {where} is {type(value).__name__}, not a "
                    f"feature list")


def _node_from_record(n: Any, what: str) -> NodeInfo:
    """One node record of `sinfo --json` (22.05) or `scontrol show nodes --json` (23.02 on):
    both have name, state (a word, or a list of words), reason, address, hostname, features,
    active_features, comment."""
    name = _field(n, "name", what, str, "a node")
    where = f"node {name!r}"
    words = _words(_field(n, "state", what, (str, list), where), what, "state", where)
    words += _words(n.get("state_flags", []), what, "state_flags", where)
    state, flags = _node_state_of(words, what, where)
    return NodeInfo(
        name=name, state=state, flags=flags, reason=_text(n, "reason", what, where),
        addr=_text(n, "address", what, where), hostname=_text(n, "hostname", what, where),
        features=_text_list(n.get("features"), what, "features", where),
        active_features=_text_list(n.get("active_features"), what, "active_features", where),
        comment=_text(n, "comment", what, where))


SINFO_JSON = "sinfo --json"
SCONTROL_NODES_JSON = "scontrol show nodes --json"


def sinfo_json_has_nodes(text: str) -> bool:
    """Whether `sinfo --json` printed one record per node (Slurm 22.05's `nodes`), rather than
    the groups of nodes of data_parser v0.0.40 on (`sinfo`: no addresses, no hostnames), for
    which `scontrol show nodes --json` is the per-node read. Neither: an HpctError."""
    return _sinfo_has_nodes(_json_doc(text, SINFO_JSON))


def _sinfo_has_nodes(doc: dict) -> bool:
    if isinstance(doc.get("nodes"), list):
        return True
    if isinstance(doc.get("sinfo"), list):
        return False
    raise HpctError(f"{SINFO_JSON}: neither field 'nodes' (Slurm 22.05) nor 'sinfo' (23.02 "
                    f"on) is a list (fields: {', '.join(sorted(doc))[:200]})")


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    """The nodes of `sinfo --json`. Slurm 22.05 (openapi v0.0.38): `nodes`, one record per
    node. 23.02 on (data_parser v0.0.39-42): `sinfo`, one record per group of alike nodes, read
    here node by node (their address and hostname are not in it: None). Anything else raises
    an HpctError naming the field."""
    return _sinfo_nodes(_json_doc(text, SINFO_JSON))


def _sinfo_nodes(doc: dict) -> list[NodeInfo]:
    """`parse_sinfo_json` of the parsed document (the text is parsed once)."""
    if _sinfo_has_nodes(doc):
        return [_node_from_record(n, SINFO_JSON) for n in doc["nodes"]]
    nodes: dict[str, NodeInfo] = {}
    for i, group in enumerate(doc["sinfo"]):
        where = f"sinfo[{i}]"
        members = _field(_field(group, "nodes", SINFO_JSON, dict, where), "nodes", SINFO_JSON,
                         list, where + ".nodes")
        words = _words(_field(_field(group, "node", SINFO_JSON, dict, where), "state",
                              SINFO_JSON, (str, list), where + ".node"),
                       SINFO_JSON, "state", where)
        state, flags = _node_state_of(words, SINFO_JSON, where)
        feats = group.get("features", {})
        if not isinstance(feats, dict):
            raise HpctError(f"{SINFO_JSON}: field 'features' of {where} is not an object")
        # `{"description": .., "time": .., "user": ..}` as 24.11 and 26.05 print it, or a string
        reason = _opt(_field(group["reason"], "description", SINFO_JSON, str, where + ".reason")) \
            if isinstance(group.get("reason"), dict) else _text(group, "reason", SINFO_JSON, where)
        for name in members:
            if not isinstance(name, str):
                raise HpctError(f"{SINFO_JSON}: {where}.nodes.nodes holds {name!r}, not a name")
            # a node is in one group per partition it is in: the same record each time
            nodes[name] = NodeInfo(
                name=name, state=state, flags=flags, reason=reason, addr=None,
                hostname=None,
                features=_text_list(feats.get("total"), SINFO_JSON, "features.total", where),
                active_features=_text_list(feats.get("active"), SINFO_JSON, "features.active",
                                           where),
                comment=_text(group, "comment", SINFO_JSON, where))
    return list(nodes.values())


def parse_scontrol_nodes_json(text: str) -> list[NodeInfo]:
    """The nodes of `scontrol show nodes --json` (Slurm 23.02 on; 22.05 has no --json)."""
    doc = _json_doc(text, SCONTROL_NODES_JSON)
    return [_node_from_record(n, SCONTROL_NODES_JSON)
            for n in _list_of(doc, "nodes", SCONTROL_NODES_JSON, "the document")]


def _hosts_or_empty(hostlist: str | None) -> list[str]:
    text = _opt(hostlist)
    return expand(text) if text else []


SCONTROL_JOB = "scontrol show job"


def _job_state_word(text: str, what: str) -> str:
    """The one word squeue's %T and scontrol's JobState print: a base state, or a flag in its
    place (JOB_STATE_FLAGS). Any other word is refused: kept as the state, it would never count
    as finished."""
    if text not in BASE_JOB_STATES | JOB_STATE_FLAGS:
        raise HpctError(f"{what} {shown(text)} is not a job state Slurm prints")
    return text


def parse_job_record(line: str) -> JobInfo:
    """One line of `scontrol show job -o`."""
    rec = parse_scontrol_record(line.rstrip("\n"))
    if "JobId" not in rec or "JobState" not in rec:
        raise HpctError(f"scontrol job record {line[:80]!r} lacks JobId or JobState")
    code, _, sig = rec.get("ExitCode", "0:0").partition(":")
    return JobInfo(
        job_id=check_job_id(rec["JobId"], f"{SCONTROL_JOB}: field 'JobId'"),
        name=_opt(rec.get("JobName")),
        user=_opt(rec.get("UserId", "").split("(")[0]),
        state=_job_state_word(rec["JobState"], f"{SCONTROL_JOB}: field 'JobState'"),
        nodelist=_hosts_or_empty(rec.get("NodeList")),
        batch_host=_opt(rec.get("BatchHost")),
        restart_count=check_uint(rec.get("Restarts", "0"), f"{SCONTROL_JOB}: field 'Restarts'"),
        reason=_opt(rec.get("Reason")),
        exit_code=check_uint(code, f"{SCONTROL_JOB}: field 'ExitCode'"),
        exit_signal=check_uint(sig or "0", f"{SCONTROL_JOB}: field 'ExitCode' (its signal)"),
        flags=None, work_dir=_opt(rec.get("WorkDir")), comment=_opt(rec.get("Comment")),
        end_time=_opt(rec.get("EndTime")))


SQUEUE_JSON = "squeue --json"
# A job's base states (slurm.h job_states); every other word of its state is a flag.
BASE_JOB_STATES = frozenset({"PENDING", "RUNNING", "SUSPENDED"}) | FINISHED_JOB_STATES


def _number(value: Any, what: str, key: str, where: str, unset: int | None = 0) -> int:
    """An integer field: a plain number (22.05), or data_parser's `{"set": true, "infinite":
    false, "number": N}` (23.02 on; not set: `unset`). ASCII digits, 32 bits (check_uint)."""
    if isinstance(value, dict) and "number" in value:
        is_set, infinite = value.get("set", True), value.get("infinite", False)
        if not isinstance(is_set, bool) or not isinstance(infinite, bool):
            raise HpctError(f"{what}: field {key!r} of {where} has 'set' {shown(str(is_set))} "
                            f"and 'infinite' {shown(str(infinite))}, not true or false")
        if not is_set or infinite:
            if unset is None:
                raise HpctError(f"{what}: field {key!r} of {where} is not set")
            return unset
        value = value["number"]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise HpctError(f"{what}: field {key!r} of {where} is {type(value).__name__} "
                        f"{str(value)[:60]!r}, not a non-negative integer")
    return check_uint(str(value), f"{what}: field {key!r} of {where}")


def _job_exit(value: Any, where: str) -> tuple[int, int]:
    """(exit code, signal) of squeue's `exit_code`: a wait() status (22.05) or `{"status":
    [...], "return_code": NUMBER, "signal": {"id": NUMBER, "name": ..}}` (23.02 on)."""
    if value is None:
        return 0, 0
    if isinstance(value, dict):
        code = _number(value.get("return_code", 0), SQUEUE_JSON, "exit_code.return_code", where)
        sig = value.get("signal", {})
        if not isinstance(sig, dict):
            raise HpctError(f"{SQUEUE_JSON}: field 'exit_code.signal' of {where} is not an "
                            f"object")
        return code, _number(sig.get("id", 0), SQUEUE_JSON, "exit_code.signal.id", where)
    status = _number(value, SQUEUE_JSON, "exit_code", where)
    return (status >> 8) & 0xFF, status & 0x7F


def _job_state(value: Any, where: str) -> str:
    """The base state of squeue's `job_state`: `"RUNNING"` (22.05, which may print a flag in
    its place, as %T does) or `["RUNNING"]`, `["PENDING", "REQUEUED"]` (23.02 on: the base
    state, then its flags; a flag this module does not know is only a flag)."""
    words = _words(value, SQUEUE_JSON, "job_state", where)
    if not words:
        raise HpctError(f"{SQUEUE_JSON}: field 'job_state' of {where} is empty")
    bases = [w for w in words if w in BASE_JOB_STATES]
    # no base state: 22.05 may print one flag in its place; anything else is no job state
    return bases[0] if bases else \
        _job_state_word(" ".join(words), f"{SQUEUE_JSON}: field 'job_state' of {where}")


def parse_squeue_json(text: str) -> list[JobInfo]:
    """The jobs of `squeue --json`: Slurm 22.05 (openapi v0.0.38: `job_state` a word,
    `exit_code` a wait() status) and 23.02 on (data_parser: `job_state` a list, `exit_code` an
    object, numbers as `{"set", "number"}` objects). A field that reads as neither raises an
    HpctError naming it."""
    doc = _json_doc(text, SQUEUE_JSON)
    jobs = []
    for i, j in enumerate(_list_of(doc, "jobs", SQUEUE_JSON, "the document")):
        job_id = check_job_id(
            _number(_field(j, "job_id", SQUEUE_JSON, (int, str, dict), f"jobs[{i}]"),
                    SQUEUE_JSON, "job_id", f"jobs[{i}]", unset=None),
            f"{SQUEUE_JSON}: field 'job_id' of jobs[{i}]")
        where = f"job {job_id}"
        code, sig = _job_exit(j.get("exit_code"), where)
        flags = j.get("flags", [])
        if not isinstance(flags, list):
            raise HpctError(f"{SQUEUE_JSON}: field 'flags' of {where} is not a list")
        nodes = j.get("nodes")
        if nodes is not None and not isinstance(nodes, str):
            raise HpctError(f"{SQUEUE_JSON}: field 'nodes' of {where} is not a hostlist")
        jobs.append(JobInfo(
            job_id=job_id, name=_text(j, "name", SQUEUE_JSON, where),
            user=_text(j, "user_name", SQUEUE_JSON, where),
            state=_job_state(_field(j, "job_state", SQUEUE_JSON, (str, list), where), where),
            nodelist=_hosts_or_empty(nodes),
            batch_host=_text(j, "batch_host", SQUEUE_JSON, where),
            restart_count=_number(j.get("restart_cnt", 0), SQUEUE_JSON, "restart_cnt",
                                  where),
            reason=_text(j, "state_reason", SQUEUE_JSON, where),
            exit_code=code, exit_signal=sig,
            flags=frozenset(_words(flags, SQUEUE_JSON, "flags", where)),
            work_dir=_text(j, "current_working_directory", SQUEUE_JSON, where)))
    return jobs


def parse_job_state(text: str) -> str | None:
    """The state word of `squeue -h -j J -o %T` (e.g. RUNNING); None when it printed nothing
    (the job is no longer known)."""
    words = text.split()
    if len(words) > 1:
        raise HpctError(f"squeue printed {text.strip()[:80]!r}, not one job state")
    return _job_state_word(words[0], "squeue -o %T: state") if words else None


def parse_steps(text: str) -> list[StepInfo]:
    """The lines of `squeue -h -s -j J -o "%i %N"`: `12.0 n1`, `12.batch n1`."""
    steps = []
    for line in text.splitlines():
        if not line.strip():
            continue
        step_id, _, nodes = line.strip().partition(" ")
        job, dot, step = step_id.rpartition(".")
        if not dot or not step:
            raise HpctError(f"squeue step line {line.strip()[:80]!r} has no JOB.STEP id")
        steps.append(StepInfo(job_id=check_job_id(job, "squeue -s: the step's job id"),
                              step=step, nodelist=_hosts_or_empty(nodes)))
    return steps


def parse_node_states(text: str) -> dict[str, str]:
    """`sinfo -h -N -o "%N %T"` -> {"n1": "idle", "n2": "down*"}: sinfo's own state words,
    with their suffixes (`*` not responding, `~` powered off, ...)."""
    states = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
        elif parts:
            raise HpctError(f"sinfo line {line.strip()[:80]!r} is not 'NODE STATE'")
    return states


def parse_reservation_nodes(text: str) -> list[str]:
    """Node names of one `scontrol show reservation -o NAME` line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) != 1:
        raise HpctError(f"scontrol show reservation printed {len(lines)} records, not 1")
    nodes = parse_scontrol_record(lines[0]).get("Nodes", "")
    return [] if nodes in ("", "(null)") else expand(nodes)


@dataclass(frozen=True)
class ReservationInfo:
    """One reservation as `scontrol show reservation -o` prints it (times are Slurm's local
    ISO times, `2026-11-23T17:00:00`, compared as such)."""

    name: str
    start: str
    end: str
    nodes: list[str]
    flags: frozenset[str]

    @property
    def maintenance(self) -> bool:
        return "MAINT" in self.flags


def parse_reservations(text: str) -> list[ReservationInfo]:
    """Every record of `scontrol show reservation -o` (none: "No reservations in the
    system")."""
    out = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("No reservations"):
            continue
        rec = parse_scontrol_record(line.strip())
        if "ReservationName" not in rec or "StartTime" not in rec:
            raise HpctError(f"scontrol reservation record {line[:80]!r} lacks "
                            f"ReservationName or StartTime")
        nodes = rec.get("Nodes", "")
        out.append(ReservationInfo(
            name=rec["ReservationName"], start=rec["StartTime"], end=rec.get("EndTime", ""),
            nodes=[] if nodes in ("", "(null)") else expand(nodes),
            flags=frozenset(f.strip().upper() for f in rec.get("Flags", "").split(",")
                            if f.strip())))
    return out


def parse_sbatch_parsable(text: str) -> int:
    """`sbatch --parsable` prints `jobid` or `jobid;cluster`."""
    try:
        return check_job_id(text.strip().split(";")[0])
    except HpctError:
        raise HpctError(f"sbatch --parsable printed {shown(text.strip())}, not a job id") \
            from None


def parse_version(text: str) -> str:
    """`slurm-wlm 22.05.8` -> "22.05.8"."""
    m = re.search(r"\b([0-9]+\.[0-9]+\.[0-9]+)\b", text)  # ASCII: \d takes '٢' too
    if not m:
        raise HpctError(f"Slurm version output {text.strip()[:60]!r} has no version number")
    return m.group(1)


def srun_argv(node: str, argv: Sequence[str], extra_opts: Sequence[str] = (),
              ntasks: int = 1, job_id: int | None = None) -> list[str]:
    """`srun -N1 -n<ntasks> -w <node> [--jobid=J] <extra_opts> <argv>`: one step on one node,
    so that a node's failure ends only its own step."""
    if expand(node) != [node]:
        raise HpctError(f"srun node {node!r} is not a single node name")
    if ntasks < 1:
        raise HpctError(f"srun ntasks {ntasks} is not a positive number")
    if not argv:
        raise HpctError("srun needs a command to run")
    cmd = ["srun", "-N1", f"-n{ntasks}", "-w", node]
    if job_id is not None:
        cmd.append(f"--jobid={job_id}")
    return [*cmd, *extra_opts, *argv]


def srun_nodes_argv(nodes: Sequence[str], argv: Sequence[str],
                    extra_opts: Sequence[str] = (), tasks_per_node: int = 1) -> list[str]:
    """`srun -N<n> -n<n*t> --ntasks-per-node=<t> -w <nodes> <extra_opts> <argv>`: one step
    with `tasks_per_node` tasks on each of `nodes`."""
    if not nodes or any(expand(n) != [n] for n in nodes):
        raise HpctError(f"srun nodes {list(nodes)!r} are not one or more single node names")
    if not argv:
        raise HpctError("srun needs a command to run")
    if isinstance(tasks_per_node, bool) or not isinstance(tasks_per_node, int) or \
            not 1 <= tasks_per_node <= 1024:
        raise HpctError(f"srun tasks per node {tasks_per_node!r} is not 1 to 1024")
    return ["srun", f"-N{len(nodes)}", f"-n{len(nodes) * tasks_per_node}",
            f"--ntasks-per-node={tasks_per_node}", "-w", ",".join(nodes), *extra_opts, *argv]


def _one_line(value: str, what: str) -> str:
    if not value.strip() or not value.isprintable():
        raise HpctError(f"{what} {value!r} is not one printable line")
    return value


def printable_line(text: str) -> str:
    """`text` as one printable line that Slurm takes as a comment or reason, character for
    character: whitespace other than ' ' (a tab, a newline, U+2028) becomes ' ', any other
    character that does not print (control characters, the bidi overrides and isolates
    U+202A-U+202E and U+2066-U+2069, other format characters) becomes '?'. A record with such
    a character in it is written cleaned, never refused."""
    return "".join(ch if ch.isprintable() else " " if ch.isspace() else "?" for ch in text)


def refused_for_now(exc: SlurmCommandError) -> bool:
    """Whether Slurm refused a job update only for now (REFUSED_FOR_NOW): worth asking again."""
    return REFUSED_FOR_NOW in exc.stderr


@contextlib.contextmanager
def sigterm_ignored() -> Iterator[None]:
    """SIGTERM ignored meanwhile, by this process and by the Slurm commands it starts (an
    ignored signal stays ignored across exec). A requeue makes Slurm signal every process of
    the job at once, the one that asked and its `scontrol` included: what has to follow the
    requeue (the job's BeginTime, its record) runs in here. Only the main thread may change a
    signal's handling: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        # None: a handler not installed from Python; SIG_DFL is what Python starts with
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def _reservation_name(name: str) -> str:
    if not _RESERVATION_NAME_RE.fullmatch(name):
        raise HpctError(f"reservation name {name!r} is not letters, digits, '_', '.', '-'")
    return name


# ---- the client --------------------------------------------------------------------------

@dataclass(frozen=True)
class BackendChoice:
    """Which backend a client uses and why (see pyslurm_backend.select_backend)."""

    name: str
    reason: str


Runner = Callable[..., subprocess.CompletedProcess]


class SlurmClient:
    """Slurm through its CLI. `env` is laid over os.environ for every command (e.g. SLURM_CONF;
    a None value removes the variable); `wrap` prefixes every argv (e.g. `nsenter
    --net=/run/netns/x --`); `runner` runs the full argv with subprocess.run's keywords
    (tests pass a stand-in that records the argv and returns a CompletedProcess)."""

    def __init__(self, env: Mapping[str, str | None] | None = None,
                 wrap: Sequence[str] | None = None, timeout: float = 30.0,
                 backend: BackendChoice = BackendChoice("cli", "CLI backend constructed directly"),
                 runner: Runner | None = None):
        self.env = dict(env or {})
        self.wrap = list(wrap or [])
        self.timeout = timeout
        self.backend = backend
        self.runner = runner or subprocess.run
        self._nodes_from_scontrol = False  # set once sinfo --json groups its nodes

    # -- plumbing --
    def command(self, argv: Sequence[str]) -> list[str]:
        """The full argv that runs `argv` the way this client does (with `wrap`)."""
        return [*self.wrap, *argv]

    def environ(self, extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
        """The environment this client runs Slurm commands with (`extra` laid over it)."""
        full = dict(os.environ)
        for key, value in {**self.env, **(extra or {})}.items():
            if value is None:
                full.pop(key, None)
            else:
                full[key] = value
        return full

    def run(self, argv: Sequence[str], timeout: float | None = None,
            env: Mapping[str, str | None] | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm command (`env` laid over the client's); raise SlurmCommandError unless
        it exits 0."""
        try:
            proc = self.runner(self.command(argv), capture_output=True, text=True,
                               env=self.environ(env), timeout=timeout or self.timeout)
        except FileNotFoundError:
            raise SlurmCommandError(argv, 127, "", what=f"{self.command(argv)[0]} is not "
                                    f"installed or not on PATH") from None
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
            raise SlurmCommandError(argv, None, stderr,
                                    what=f"no answer within {timeout or self.timeout:g} s") \
                from None
        if proc.returncode != 0:
            raise SlurmCommandError(argv, proc.returncode, proc.stderr or proc.stdout)
        return proc

    # -- reading --
    def version(self) -> str:
        return parse_version(self.run(["scontrol", "--version"]).stdout)

    def show_node(self, name: str) -> NodeInfo:
        if expand(name) != [name]:
            raise HpctError(f"node name {name!r} is not a single node name")
        out = self.run(["scontrol", "show", "node", "-o", name]).stdout
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if len(lines) != 1:
            raise HpctError(f"scontrol show node {name} printed {len(lines)} records, not 1")
        return parse_node_record(lines[0])

    def nodes(self) -> list[NodeInfo]:
        """Every node, from JSON (structured: free-text reasons parse safely): `sinfo --json`
        where it prints one record per node (Slurm 22.05), else `scontrol show nodes --json`
        (23.02 on, whose sinfo groups nodes and leaves out their addresses). Which one is
        remembered after the first read."""
        if not self._nodes_from_scontrol:
            doc = _json_doc(self.run(["sinfo", "--json"]).stdout, SINFO_JSON)
            if _sinfo_has_nodes(doc):
                return _sinfo_nodes(doc)
            self._nodes_from_scontrol = True
        return parse_scontrol_nodes_json(self.run(["scontrol", "show", "nodes", "--json"]).stdout)

    def show_job(self, job_id: int) -> JobInfo:
        out = self.run(["scontrol", "show", "job", "-o", str(int(job_id))]).stdout
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if len(lines) != 1:
            raise HpctError(f"scontrol show job {job_id} printed {len(lines)} records, not 1")
        return parse_job_record(lines[0])

    def jobs(self, user: str | None = None, job_ids: Sequence[int] = ()) -> list[JobInfo]:
        """Jobs slurmctld still remembers (finished ones too, until MinJobAge), with flags.

        Filtered here: Slurm 22.05 ignores --user/--jobs when it prints --json. `--states=all`:
        from 23.x on squeue --json honours squeue's default filter, which hides finished jobs
        (22.05 ignores it and lists them anyway)."""
        wanted = {int(j) for j in job_ids}
        return [j for j in parse_squeue_json(self.run(["squeue", "--json", "--states=all"]).stdout)
                if (user is None or j.user == user) and (not wanted or j.job_id in wanted)]

    def show_hostnames(self, hostlist: str) -> list[str]:
        # "--" keeps a hostlist that starts with '-' from being read as an option
        argv = ["scontrol", "--", "show", "hostnames", hostlist]
        proc = self.run(argv)
        if "Invalid hostlist" in proc.stderr or "Invalid hostlist" in proc.stdout:
            raise SlurmCommandError(argv, 0, proc.stderr)
        return proc.stdout.split()

    def status_text(self) -> str:
        """Slurm's own view, for a person reading a failure: the queue (job, state, reason,
        start time, nodes) and every node's state and reason, as squeue and sinfo print them.
        A command that fails is reported in the text, not raised: this is read beside another
        error, which it must not replace."""
        parts = []
        for argv in (["squeue", "-a", "-o", "%i %T %r %S %N"], ["sinfo", "-N", "-o", "%N %T %E"]):
            try:
                parts.append("$ " + " ".join(argv) + "\n" + self.run(argv).stdout)
            except SlurmCommandError as exc:
                parts.append(f"$ {' '.join(argv)}: {exc}")
        return "\n".join(parts)

    def node_states(self) -> dict[str, str]:
        """sinfo's own state word of every node (`idle`, `down*`, `drained`, ...)."""
        return parse_node_states(self.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout)

    def ping(self, timeout: float = 10.0) -> bool:
        """Whether slurmctld answers `scontrol ping` (exit 0) within `timeout`."""
        try:
            self.run(["scontrol", "ping"], timeout=timeout)
        except SlurmCommandError as exc:
            if exc.returncode == 127:
                raise  # scontrol is missing: not an answer either way
            return False
        return True

    def job_finished(self, job_id: int) -> bool:
        """Whether the job has ended: in one of FINISHED_JOB_STATES, or no longer known to
        slurmctld (purged after MinJobAge)."""
        out = self._output_unless(["squeue", "-h", "-j", str(int(job_id)), "-o", "%T"],
                                  "Invalid job id")
        if out is None:
            return True
        state = parse_job_state(out)
        return state is None or state in FINISHED_JOB_STATES

    def job_steps(self, job_id: int) -> list[StepInfo]:
        """The job's steps now running (numbered ones, `batch`, `extern`)."""
        out = self.run(["squeue", "-h", "-s", "-j", str(int(job_id)), "-o", "%i %N"]).stdout
        return parse_steps(out)

    def reservation_nodes(self, name: str) -> list[str] | None:
        """The nodes of reservation `name`; None when there is no such reservation."""
        out = self._output_unless(["scontrol", "show", "reservation", "-o",
                                   _reservation_name(name)], "not found")
        return None if out is None else parse_reservation_nodes(out)

    def reservations(self) -> list[ReservationInfo]:
        """Every reservation (maintenance ones carry the MAINT flag)."""
        return parse_reservations(self.run(["scontrol", "show", "reservation", "-o"]).stdout)

    def _output_unless(self, argv: list[str], absent: str) -> str | None:
        """The command's stdout; None when it failed saying `absent` (what it asked about
        does not exist, which is an answer, not an error)."""
        try:
            return self.run(argv).stdout
        except SlurmCommandError as exc:
            if absent in exc.stderr:
                return None
            raise

    def show_hostlist(self, hosts: Sequence[str]) -> str:
        argv = ["scontrol", "--", "show", "hostlist", ",".join(hosts)]
        proc = self.run(argv)
        if "Invalid hostlist" in proc.stderr or "Invalid hostlist" in proc.stdout:
            raise SlurmCommandError(argv, 0, proc.stderr)
        return proc.stdout.strip()

    # -- acting --
    def config_text(self) -> str:
        """`scontrol show config`'s text (the fence reads the controller hosts from it)."""
        return self.run(["scontrol", "show", "config"]).stdout

    def update_node(self, names: str | Sequence[str], state: str,
                    reason: str | None = None) -> None:
        """`scontrol update NodeName=<hostlist> State=<state> [Reason=<reason>]`."""
        hostlist = names if isinstance(names, str) else compress(names)
        expand(hostlist)  # our clear error rather than slurmctld's "Invalid node name"
        state = state.upper()
        if state not in UPDATE_NODE_STATES:
            raise HpctError(f"node state {state!r} is not one of "
                            f"{', '.join(sorted(UPDATE_NODE_STATES))}")
        if reason is not None and (not reason.strip() or not reason.isprintable()):
            raise HpctError(f"node reason {reason!r} is not one printable line")
        if state in _STATES_NEEDING_REASON and reason is None:
            raise HpctError(f"node state {state} needs a reason (Slurm refuses it without one)")
        argv = ["scontrol", "update", f"NodeName={hostlist}", f"State={state}"]
        if reason is not None:
            argv.append(f"Reason={reason}")
        self.run(argv)

    def set_node_features(self, name: str, features: Sequence[str],
                          comment: str | None = None) -> None:
        """Set a node's AvailableFeatures and ActiveFeatures to `features` (and its Comment):
        `scontrol update NodeName=<name> AvailableFeatures=.. ActiveFeatures=.. [Comment=..]`."""
        if expand(name) != [name]:
            raise HpctError(f"node name {name!r} is not a single node name")
        bad = [f for f in features if not f.isprintable() or not f or set(f) & set(", =")]
        if bad:
            raise HpctError(f"node feature(s) {bad!r} are empty or hold ',', ' ' or '='")
        feats = ",".join(features)
        argv = ["scontrol", "update", f"NodeName={name}", f"AvailableFeatures={feats}",
                f"ActiveFeatures={feats}"]
        if comment is not None:
            argv.append(f"Comment={_one_line(comment, 'node comment')}")
        self.run(argv)

    def create_reservation(self, name: str, nodes: Sequence[str], users: str,
                           start: str = "now", duration: str = "infinite") -> None:
        """`scontrol create reservation ReservationName=.. StartTime=.. Duration=.. Users=..
        Nodes=<hostlist>`."""
        if not nodes:
            raise HpctError(f"reservation {name!r} needs at least one node (Slurm has no "
                            f"empty reservation)")
        argv = ["scontrol", "create", "reservation", f"ReservationName={_reservation_name(name)}",
                f"StartTime={start}", f"Duration={duration}",
                f"Users={_one_line(users, 'reservation users')}",
                f"Nodes={compress(list(dict.fromkeys(nodes)))}"]
        self.run(argv)

    def update_reservation(self, name: str, nodes: Sequence[str]) -> None:
        """Make reservation `name` hold exactly `nodes`."""
        if not nodes:
            raise HpctError(f"reservation {name!r} needs at least one node: delete it instead")
        self.run(["scontrol", "update", f"ReservationName={_reservation_name(name)}",
                  f"Nodes={compress(list(dict.fromkeys(nodes)))}"])

    def delete_reservation(self, name: str) -> None:
        self.run(["scontrol", "delete", f"ReservationName={_reservation_name(name)}"])

    def reconfigure(self) -> None:
        """`scontrol reconfigure`: slurmctld and every slurmd re-read their configuration."""
        self.run(["scontrol", "reconfigure"])

    def set_job_comment(self, job_id: int, comment: str) -> None:
        """`scontrol update JobId=J Comment=..`: a line the job's owner may set on their own
        job, shown by `scontrol show job` and `squeue -O comment` (the lifecycle's record)."""
        text = _one_line(comment, "job comment")
        if len(text) > 250:
            raise HpctError(f"job comment of {len(text)} characters is over 250: keep the "
                            f"summary short")
        self.run(["scontrol", "update", f"JobId={int(job_id)}", f"Comment={text}"])

    def reboot_nodes(self, names: str | Sequence[str], reason: str,
                     next_state: str = "RESUME") -> None:
        """`scontrol reboot ASAP nextstate=<RESUME|DOWN> reason=.. <hostlist>`: reboot once the
        node is idle, keep it from new work until then, and come back in `next_state`."""
        hostlist = names if isinstance(names, str) else compress(names)
        expand(hostlist)
        next_state = next_state.upper()
        if next_state not in ("RESUME", "DOWN"):
            raise HpctError(f"reboot next state {next_state!r} is not RESUME or DOWN")
        self.run(["scontrol", "reboot", "ASAP", f"nextstate={next_state}",
                  f"reason={_one_line(reason, 'reboot reason')}", hostlist])

    def requeue(self, job_id: int, begin_in_s: float | None = REQUEUE_BEGIN_S,
                on_refused: Callable[[SlurmCommandError], None] | None = None,
                on_requeued: Callable[[], None] | None = None) -> str | None:
        """`scontrol requeue J`, then the job eligible again `begin_in_s` seconds from now
        instead of after Slurm's hold (REQUEUE_BEGIN_S says why): `scontrol update JobId=J
        StartTime=now+N`, the same moment on every try. A refusal for now is tried again, at
        most REQUEUE_BEGIN_TRIES times and only while that moment is ahead; each refused try
        that is tried again goes to `on_refused` (the caller's event). Returns None when the
        BeginTime is set, else why not (Slurm's message: the job is requeued all the same, it
        then waits out Slurm's hold). Raises SlurmCommandError when the requeue itself fails.
        Run it inside `sigterm_ignored()`: the requeue signals the caller's job.
        `on_requeued` is called once the requeue is done, before the update (which Slurm's
        KillWait may cut short): the caller's record of it."""
        self.run(["scontrol", "requeue", str(int(job_id))])
        if on_requeued is not None:
            on_requeued()
        if begin_in_s is None:
            return None
        at = time.monotonic() + begin_in_s
        attempt = 0
        while True:
            attempt += 1
            try:
                self.run(["scontrol", "update", f"JobId={int(job_id)}",
                          f"StartTime=now+{max(1, math.ceil(at - time.monotonic()))}"])
                return None
            except SlurmCommandError as exc:
                # tried again after a pause of 1 s, while the moment is still ahead after it
                if not refused_for_now(exc) or attempt >= REQUEUE_BEGIN_TRIES or \
                        at - time.monotonic() < 2.0:
                    return exc.message
                if on_refused is not None:
                    on_refused(exc)
                time.sleep(1.0)

    def release_now(self, job_id: int) -> None:
        """Make a pending job eligible now: Slurm holds a requeued job back for about two
        minutes (its BeginTime); an admin who has repaired the nodes may start it at once.
        A job Slurm requeued *held* (a batch launch that failed) is released too."""
        self.run(["scontrol", "update", f"JobId={int(job_id)}", "StartTime=now"])
        info = self.show_job(job_id)
        if info.state == "PENDING" and "held" in (info.reason or "").lower():
            self.run(["scontrol", "release", str(int(job_id))])

    def cancel(self, job_id: int, step: int | None = None, signal: str | None = None) -> None:
        """scancel a job or one step. Slurm 22.05 exits 0 for an unknown job id."""
        target = f"{int(job_id)}" if step is None else f"{int(job_id)}.{int(step)}"
        argv = ["scancel"]
        if signal is not None:
            if not re.fullmatch(r"[A-Z0-9]+", signal):
                raise HpctError(f"signal {signal!r} is not a signal name or number")
            argv.append(f"--signal={signal}")
        self.run([*argv, target])

    def cancel_user(self, user: str) -> None:
        """scancel every job of `user`, the batch shell and every step (`--full`)."""
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", user):
            raise HpctError(f"user name {user!r} is not a user name")
        self.run(["scancel", "--full", "--user", user])

    def srun(self, node: str, argv: Sequence[str], options: Sequence[str] = (),
             timeout: float | None = None) -> subprocess.CompletedProcess:
        """Run `argv` as one task on `node` and wait for it (output captured): see srun_argv.
        Raises SlurmCommandError unless it exits 0."""
        return self.run(srun_argv(node, argv, extra_opts=options), timeout=timeout)

    def run_step(self, nodes: Sequence[str], argv: Sequence[str],
                 options: Sequence[str] = (), tasks_per_node: int = 1) -> int:
        """Run `argv` as one step with `tasks_per_node` tasks on each of `nodes` (see
        srun_nodes_argv), its output going where this process's goes, no time limit; return
        srun's exit code."""
        cmd = srun_nodes_argv(nodes, argv, options, tasks_per_node)
        try:
            return self.runner(self.command(cmd), stdin=subprocess.DEVNULL,
                               env=self.environ()).returncode
        except FileNotFoundError:
            raise SlurmCommandError(cmd, 127, "", what=f"{self.command(cmd)[0]} is not "
                                    f"installed or not on PATH") from None

    def sbatch(self, script: str | os.PathLike | None = None, options: Sequence[str] = (),
               wrap: str | None = None, script_args: Sequence[str] = (),
               env: Mapping[str, str | None] | None = None) -> int:
        """Submit a batch script with `script_args` (or `--wrap` a command line); return the job
        id. `env` is laid over the client's environment (sbatch exports it to the job)."""
        if (script is None) == (wrap is None):
            raise HpctError("sbatch needs exactly one of a script path or a --wrap command")
        argv = ["sbatch", "--parsable", *options]
        if script is not None:
            path = Path(script)
            if not path.is_file():
                raise HpctError(f"batch script {str(path)!r} does not exist")
            argv += [str(path), *script_args]
        else:
            argv.append(f"--wrap={wrap}")
        return parse_sbatch_parsable(self.run(argv, env=env).stdout)
