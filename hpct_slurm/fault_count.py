"""What counts as one fault: the one rule behind the job's Slurm comment ("N fault(s)", the
controller) and the fault list of `hpct-slurm status` (report/model.py), applied to the
controller's own records in the order it writes them (issue 45.4).

* A node's `fault.detected` is a fault, unless the same node was detected already in the
  round in progress: one loss is often seen twice (its connection ends, then its step exits
  137) and the round takes it in once.
* A node in `fault.second` that no `fault.detected` of the round named (a survivor that
  failed its health check or never answered) is a fault too.
* A round ends with its assignment (`recovery.assign`, `move.assign`, `grow.assign`) or,
  before generation 0, `fault.before_start`: a node lost again after that is a new fault.
* A rank that reported a fault of its own (an in-place restart) and reports one again before
  the round it caused was done (no `recovery.done` since: the step it failed in never
  completed) is the same fault retried, not another: a script error that repeats at one step
  is one fault however many times the group restarts in place before it gives up. Once a
  round is done, the next report is a new fault.
* Once the job's end is decided (`job.done`, `job.failed`, an escalation, SIGTERM) the ranks
  leave: their connections ending and their steps exiting are no fault. A requeued run
  (`controller.start` again) counts on.
"""
from __future__ import annotations

import threading
from typing import Any

from .events import Ev, EventLog

# The reason a controller gives a rank's own report of a failed step (controller/detection.py)
IN_PROCESS = "rank reported a fault"

ROUND_ENDS = frozenset({Ev.RECOVERY_ASSIGN, Ev.MOVE_ASSIGN, Ev.GROW_ASSIGN,
                        Ev.FAULT_BEFORE_START, Ev.CONTROLLER_START})
JOB_ENDS = frozenset({Ev.JOB_DONE, Ev.JOB_FAILED, Ev.ESCALATE_REQUEUE, Ev.ESCALATE_FAIL,
                      Ev.CONTROLLER_TERMINATED})


class FaultCount:
    """Feed it the controller's records in order (`see`); `count` is the job's faults."""

    def __init__(self) -> None:
        self.count = 0
        self._round: set[str] = set()  # nodes already counted in the round in progress
        self._in_place: set[str] = set()  # nodes that reported their own fault in this round
        self._retrying: set[str] = set()  # ... in the last round, which is not done yet
        self.ended = False  # the job's end is written: its ranks leave, no fault

    def see(self, record: dict[str, Any]) -> list[str]:
        """The nodes whose new fault this record is (most records: none)."""
        event = record.get("event")
        if event == Ev.CONTROLLER_START:
            self.ended = False
            self._in_place.clear()
        if event in ROUND_ENDS:
            self._round.clear()
            self._retrying, self._in_place = self._in_place, set()
            return []
        if event == Ev.RECOVERY_DONE:
            self._retrying.clear()
            return []
        if event in JOB_ENDS:
            self.ended = True
            return []
        if self.ended:
            return []
        if event == Ev.FAULT_DETECTED:
            nodes = [record.get("node")]
            if record.get("reason") == IN_PROCESS:
                self._in_place.update(n for n in nodes if isinstance(n, str))
                nodes = [n for n in nodes if n not in self._retrying]
        elif event == Ev.FAULT_SECOND:
            nodes = record.get("nodes") or []
        else:
            return []
        new = [n for n in nodes if isinstance(n, str) and n not in self._round]
        self._round.update(new)
        self.count += len(new)
        return new


class CountingLog(EventLog):
    """The controller's event log, which counts its faults as it writes them (`faults`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.faults = FaultCount()
        self._order = threading.Lock()  # counted in the order written

    def emit(self, event: Ev | str, **fields: Any) -> dict:
        with self._order:
            record = super().emit(event, **fields)
            self.faults.see(record)
        return record
