"""Structured events: one JSON object a line, with a stable set of names.

The controller, the ranks, the hooks, the report and the tests all read the same record, so
event names are constants here (`Ev`) and nowhere else: `EventLog.emit` refuses a name that is
not registered, so a typo fails where it is written instead of silently breaking
`hpct-slurm report`. The states a rank reports and the controller tracks (`RankState`) and the
roles a process registers with (`Role`) are registered here too. All three are str-valued: the
JSON lines hold the plain strings, and a member compares equal to its string.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import sys
import threading
import time
from enum import Enum, unique
from pathlib import Path
from typing import IO, Any, Iterator

from .errors import HpctError


class _Name(str, Enum):
    """A str-valued enum that prints, formats and serializes as its plain value."""

    def __str__(self) -> str:
        return str.__str__(self)

    __format__ = str.__format__


@unique
class Ev(_Name):
    """Every event name any part of hpct-slurm emits (docs/troubleshooting.md says what each
    means)."""

    # controller (controller.jsonl)
    CONTROLLER_START = "controller.start"
    CONTROLLER_EXIT = "controller.exit"
    CONTROLLER_TERMINATED = "controller.terminated"
    CONTROLLER_SPARES_SHORT = "controller.spares_short"
    CONTROLLER_STORE_UNAUTHENTICATED = "controller.store_unauthenticated"
    CONTROLLER_PERSISTED_STEP_INCOMPLETE = "controller.persisted_step_incomplete"
    CONTROLLER_RESUME_FROM_DISK = "controller.resume_from_disk"
    CONTROLLER_ACCEPT_FAILED = "controller.accept_failed"
    STEP_LAUNCH = "step.launch"
    STEP_EXIT = "step.exit"
    RANK_REGISTER = "rank.register"
    RELAY_REGISTER = "relay.register"
    GENERATION_START = "generation.start"
    FAULT_DETECTED = "fault.detected"
    FAULT_IN_PROCESS = "fault.in_process"
    FAULT_BEFORE_START = "fault.before_start"
    FAULT_STOP_SENT = "fault.stop_sent"
    FAULT_FENCED = "fault.fenced"
    FAULT_STEP_LINGERS = "fault.step_lingers"
    FAULT_SECOND = "fault.second"
    RECOVERY_SHRINK = "recovery.shrink"
    RECOVERY_ASSIGN = "recovery.assign"
    RECOVERY_DISK_FALLBACK = "recovery.disk_fallback"
    RECOVERY_DONE = "recovery.done"
    RECOVERY_FAILED = "recovery.failed"
    RECOVERY_SPARE_WAIT = "recovery.spare_wait"
    RECOVERY_SPARE_WAIT_OVER = "recovery.spare_wait_over"
    FORMATION_BROKEN = "formation.broken"
    ESCALATE_REQUEUE = "escalate.requeue"
    ESCALATE_REQUEUED = "escalate.requeued"
    ESCALATE_FAIL = "escalate.fail"
    ESCALATE_ELIGIBLE = "escalate.eligible"
    JOB_DONE = "job.done"
    JOB_FAILED = "job.failed"
    POOL_BORROW = "pool.borrow"
    POOL_BORROW_FAILED = "pool.borrow_failed"
    POOL_SPARE_JOINED = "pool.spare_joined"
    PROTOCOL_REJECTED = "protocol.rejected"
    CONNECTION_LOST = "connection.lost"
    PROTOCOL_UNEXPECTED = "protocol.unexpected"
    SLURM_ERROR = "slurm.error"
    # the node lifecycle (controller/lifecycle.py): planned moves, growing back, the record
    MOVE_REQUESTED = "move.requested"
    MOVE_SKIPPED = "move.skipped"
    MOVE_REQUEST_REFUSED = "move.request_refused"
    MOVE_REQUESTS_UNREADABLE = "move.requests_unreadable"
    MOVE_ASSIGN = "move.assign"
    MOVE_DONE = "move.done"
    MOVE_FAILED = "move.failed"
    MOVE_CUT_SHORT = "move.cut_short"
    MOVE_LEAVING_LOST = "move.leaving_lost"
    GROW_ASSIGN = "grow.assign"
    GROW_DONE = "grow.done"
    SLURM_COMMENT = "slurm.comment"
    NODE_REBOOT = "node.reboot"
    NODE_SLOW = "node.slow"
    NODE_SLOW_DISMISSED = "node.slow_dismissed"
    NODE_SLOW_FIGURE_REFUSED = "node.slow_figure_refused"
    NODE_CORRUPT = "node.corrupt"

    # ranks (events/<node>-<local rank>.jsonl)
    RANK_REGISTERED = "rank.registered"
    RANK_MESH_INFERRED = "rank.mesh_inferred"
    RANK_MAIN_AGAIN = "rank.main_again"
    RANK_LOSSES_UNREAD = "rank.losses_unread"
    RANK_ADOPTED = "rank.adopted"
    RANK_STEP = "rank.step"
    BENCH_STEP = "bench.step"  # bench/steplog.py: every system's step, at one point of its loop
    RANK_FAULT = "rank.fault"
    RANK_SCRIPT_ERROR = "rank.script_error"
    RANK_READY = "rank.ready"
    RANK_FINISHED = "rank.finished"
    RANK_TEARDOWN_HUNG = "rank.teardown_hung"
    RANK_EXIT = "rank.exit"
    RANK_CONTROLLER_ALIVE = "rank.controller_alive"
    RANK_ISOLATED = "rank.isolated"
    RANK_BATCH_HOST_ALIVE = "rank.batch_host_alive"
    RANK_STUCK = "rank.stuck"
    RANK_CONTROLLER_LOST = "rank.controller_lost"
    RANK_REQUEUED_JOB = "rank.requeued_job"
    RANK_REQUEUE_BEGIN = "rank.requeue_begin"
    RANK_REQUEUE_SKIPPED = "rank.requeue_skipped"
    RANK_REQUEUE_FAILED = "rank.requeue_failed"
    RANK_SEVERED = "rank.severed"
    RANK_PAIRS_WOKEN = "rank.pairs_woken"
    RANK_CARRY_TOO_BIG = "rank.carry_too_big"
    RANK_STATE_MOVED_AFTER_REDUCE = "rank.state_moved_after_reduce"
    RANK_SEVER_FAILED = "rank.sever_failed"
    FAULT_INJECTED = "fault.injected"
    RANK_ABORTED = "rank.aborted"
    RANK_ABORT_FAILED = "rank.abort_failed"
    RANK_ABORT_HUNG = "rank.abort_hung"
    RANK_UNEXPECTED_MESSAGE = "rank.unexpected_message"
    # a node relay, in its first local rank's process (relay/node.py)
    RELAY_START = "relay.start"
    RELAY_REJECTED = "relay.rejected"
    RELAY_CONTROLLER_LOST = "relay.controller_lost"
    RELAY_RANK_CUT = "relay.rank_cut"
    RELAY_RANK_REFUSED = "relay.rank_refused"
    RELAY_CONNECTION_EVICTED = "relay.connection_evicted"
    RELAY_ACCEPT_FAILED = "relay.accept_failed"
    RELAY_FAILED = "relay.failed"
    RENDEZVOUS_FORMED = "rendezvous.formed"
    SNAPSHOT_CAPTURED_AT_FAULT = "snapshot.captured_at_fault"
    SNAPSHOT_COPY_FAILED = "snapshot.copy_failed"
    SNAPSHOT_NOT_THE_STEP = "snapshot.not_the_step"
    SNAPSHOT_FOLLOW_UP_FAILED = "snapshot.follow_up_failed"
    RESTORE_REPLICA_MISSING = "restore.replica_missing"
    RESTORE_PROVEN = "restore.proven"
    RESTORE_UNPROVEN = "restore.unproven"
    REPLICA_DIVERGED = "replica.diverged"
    REPLICA_CHECK_OFF = "replica.check_off"
    REPLICA_ROLLED_BACK = "replica.rolled_back"
    REPLICA_STORED = "replica.stored"
    REPLICA_REJECTED = "replica.rejected"
    REPLICA_PUSH_FAILED = "replica.push_failed"
    TRANSFER_FETCHED = "transfer.fetched"
    TRANSFER_SOURCE_FAILED = "transfer.source_failed"
    TRANSFER_FALLBACK_DISK = "transfer.fallback_disk"
    TRANSFER_SERVE_CORRUPT = "transfer.serve_corrupt"
    TRANSFER_BAD_FRAME = "transfer.bad_frame"
    TRANSFER_CONNECTION_LOST = "transfer.connection_lost"
    TRANSFER_CONNECTION_EVICTED = "transfer.connection_evicted"
    TRANSFER_CONNECTION_REFUSED = "transfer.connection_refused"
    TRANSFER_ACCEPT_FAILED = "transfer.accept_failed"
    TRANSFER_FAULT_INJECTED = "transfer.fault_injected"
    TRANSFER_SOURCE_DROPPED = "transfer.source_dropped"
    TRANSFER_STRIPED = "transfer.striped"
    PERSIST_SAVED = "persist.saved"
    PERSIST_SAVE_FAILED = "persist.save_failed"
    PERSIST_CORRUPT = "persist.corrupt"

    # the rootless rendezvous store's shards
    STORE_AUTH_REJECTED = "store.auth_rejected"
    STORE_SHARD_STARTED = "store.shard_started"
    STORE_SHARD_STOPPED = "store.shard_stopped"
    STORE_ACCEPT_FAILED = "store.accept_failed"

    # any process's own event log (EventLog, below)
    EVENT_LOG_DELAYED = "event_log.delayed"

    # the node hooks (Prolog, Epilog)
    HOOK_JOB_DIR = "hook_job_dir"
    HOOK_STALE_REMOVED = "hook_stale_removed"
    HOOK_STALE_SKIPPED = "hook_stale_skipped"
    HOOK_STALE_REMOVE_FAILED = "hook_stale_remove_failed"
    HOOK_HEALTH_FAILED = "hook_health_failed"
    HOOK_DRAIN_FAILED = "hook_drain_failed"
    HOOK_JOB_DIR_REMOVED = "hook_job_dir_removed"
    HOOK_JOB_DIR_REMOVE_FAILED = "hook_job_dir_remove_failed"
    HOOK_FAILED = "hook_failed"
    HOOK_FENCE_INSTALLED = "hook_fence_installed"
    HOOK_FENCE_REMOVED = "hook_fence_removed"
    HOOK_FENCE_SKIPPED = "hook_fence_skipped"

    # the baselines (examples/baseline_train.py, bench/restart_all.py)
    BASELINE_IMPORTED = "baseline.imported"
    BASELINE_PG_READY = "baseline.pg_ready"
    BASELINE_START = "baseline.start"
    BASELINE_LAUNCH = "baseline.launch"
    BASELINE_STEP_EXIT = "baseline.step_exit"
    BASELINE_RESTART_ALL = "baseline.restart_all"
    BASELINE_NO_SPARE = "baseline.no_spare"


NAMES: frozenset[str] = frozenset(e.value for e in Ev)


class RankState(_Name):
    """Where one rank process stands: what its heartbeats say (recovery/job.py sets them), and
    the two states only the controller gives a connection (registered, assigned)."""

    REGISTERING = "registering"  # connecting; not yet accepted
    REGISTERED = "registered"    # controller: Register accepted, no assignment yet
    ASSIGNED = "assigned"        # controller: an Assign sent, no heartbeat of it back yet
    FORMING = "forming"          # forming the generation's process group, restoring
    RUNNING = "running"          # training
    COLLECTIVE = "collective"    # inside a collective
    READY = "ready"              # stopped after a fault, healthy, waiting for an Assign
    UNHEALTHY = "unhealthy"      # failed its health check
    DONE = "done"                # finished the script


# What a rank may say in a heartbeat; anything else is refused by the controller.
HEARTBEAT_STATES: frozenset[str] = frozenset(
    s.value for s in RankState if s not in (RankState.REGISTERED, RankState.ASSIGNED))


class Role(_Name):
    """What a process registers as, and the controller's view of a node."""

    ACTIVE = "active"
    SPARE = "spare"


def check_name(event: str) -> str:
    """`event` as the plain string written to the log; raises unless it is registered."""
    name = str(event)
    if name not in NAMES:
        raise HpctError(f"event name {name!r} is not registered in hpct_slurm.events.Ev: "
                        f"add it there (and to docs/troubleshooting.md)")
    return name


# A record the log file cannot take for want of a resource (the process or the system out of
# descriptors, memory, disk space): the server, accept loop or watchdog that wrote it must go on
# (an exception here ended them), so it is held, at most HOLD_MAX of them, and written before
# the next record that can be, after a summary (`event_log.delayed`); past HOLD_MAX records
# are only counted. Anything else (a link planted where the log goes, a directory that refuses
# us) is a broken set-up and still raises.
HOLD_MAX = 256
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.ENOSPC,
                        errno.EDQUOT, errno.EIO})
# The stderr line that says records are held: at most once per this long per log.
NOTE_EVERY_S = 30.0


class EventLog:
    """Append-only JSON-lines writer; safe to share between threads."""

    def __init__(self, path: str | os.PathLike | None = None, stream: IO[str] | None = None,
                 source: str = ""):
        self._path = Path(path) if path else None
        self._stream = stream
        self._source = source
        self._lock = threading.Lock()
        self._held: list[str] = []       # lines not written yet, oldest first
        self._dropped: dict[str, int] = {}  # event -> records beyond HOLD_MAX, lost
        self._failing: tuple[float, str] | None = None  # (since, why) the file takes nothing
        self._noted = -NOTE_EVERY_S      # monotonic time of the last stderr line
        self._torn = False               # a write stopped part-way: the file ends mid-line
        if self._path:
            self._path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: Ev | str, **fields: Any) -> dict:
        """Append one record; `event` must be a registered name (an `Ev`). Never raises for
        want of a descriptor or disk space: the record is held (see HOLD_MAX)."""
        record = {"t": time.time(), "event": check_name(event)}
        if self._source:
            record["source"] = self._source
        record.update(fields)
        line = json.dumps(record, sort_keys=False, default=str)
        with self._lock:
            if self._path:
                self._write(line)
            if self._stream:
                self._stream.write(line + "\n")
                self._stream.flush()
        return record

    @property
    def held(self) -> int:
        """Records waiting for the file to take them again."""
        return len(self._held) + sum(self._dropped.values())

    def flush(self) -> bool:
        """Write the held records if the file takes them now (an accept loop calls this once
        it accepts again, the controller's watchdog every sweep); True when none are left."""
        with self._lock:
            return not (self._held or self._dropped) or self._write(None)

    def _write(self, line: str | None) -> bool:
        assert self._path is not None
        lines = list(self._held)
        if self._failing is not None and (self._held or self._dropped):
            lines.append(json.dumps(self._summary()))
        if line is not None:
            lines.append(line)
        data = ("\n" if self._torn else "") + "".join(x + "\n" for x in lines)
        try:
            _append(self._path, data.encode())
        except _Unwritten as exc:
            self._torn = self._torn or exc.torn
            self._hold(line, exc.cause)
            return False
        self._held, self._dropped, self._failing, self._torn = [], {}, None, False
        return True

    def _summary(self) -> dict:
        assert self._failing is not None
        since, why = self._failing
        record: dict[str, Any] = {"t": time.time(), "event": Ev.EVENT_LOG_DELAYED.value}
        if self._source:
            record["source"] = self._source
        record.update(written_late=len(self._held), dropped=sum(self._dropped.values()),
                      dropped_events=dict(self._dropped), error=why,
                      for_s=round(time.monotonic() - since, 3))
        return record

    def _hold(self, line: str | None, cause: OSError) -> None:
        why = f"{cause.strerror or cause} (errno {cause.errno})"
        if self._failing is None:
            self._failing = (time.monotonic(), why)
        if line is not None:
            if len(self._held) < HOLD_MAX:
                self._held.append(line)
            else:
                name = json.loads(line)["event"]
                self._dropped[name] = self._dropped.get(name, 0) + 1
        now = time.monotonic()
        if now - self._noted >= NOTE_EVERY_S:  # stderr is open already: no descriptor needed
            self._noted = now
            with contextlib.suppress(OSError, ValueError):
                print(f"hpct-slurm: event log {self._path} cannot be written: {why}; "
                      f"{len(self._held)} record(s) held, {sum(self._dropped.values())} "
                      f"dropped, written when it can be", file=sys.stderr, flush=True)


class _Unwritten(Exception):
    """The log file could not take a record for want of a resource (`cause`); `torn`: some of
    it was written, so the file now ends mid-line."""

    def __init__(self, cause: OSError, torn: bool):
        super().__init__(str(cause))
        self.cause, self.torn = cause, torn


# Never through a symlink, never into a fifo or a device: the hooks log as root and the
# controller as the job's user, and a link planted where a log goes would make them append to
# whatever file it points at (O_NONBLOCK: a planted fifo fails at once instead of hanging).
_APPEND_FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC)


def _append(path: Path, data: bytes) -> None:
    # Opened and closed per record, although a rank writes one or two a step: on NFS a record
    # reaches the server (and other nodes' readers) at its close, and a newcomer reads its
    # lost predecessor's loss records from this file (recovery/losses.py); a descriptor kept
    # open would leave them in the dead node's cache.
    try:
        fd = os.open(path, _APPEND_FLAGS, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise HpctError(f"event log {path} is a symlink; logs are never written through "
                            f"a link: remove it") from None
        if exc.errno in _TRANSIENT:
            raise _Unwritten(exc, torn=False) from None
        raise HpctError(f"event log {path} cannot be opened ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HpctError(f"event log {path} is not a regular file: remove it")
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except OSError as exc:
                if exc.errno not in _TRANSIENT:
                    raise
                raise _Unwritten(exc, torn=len(view) < len(data)) from None
    finally:
        os.close(fd)


def read_events(path: str | os.PathLike) -> Iterator[dict]:
    """Yield events from a JSON-lines file, skipping a torn last line."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def stderr_log(source: str = "") -> EventLog:
    return EventLog(stream=sys.stderr, source=source)
