"""The losses a rank recorded before a fault, for the process that takes its position.

`job.losses` is this process's record of each step's loss. A warm spare that replaces a lost
rank trained none of that rank's earlier steps; their losses are in the run's events (every
process writes a `rank.step` event per step, with its `loss`, under $HPCT_RUN_DIR/events/),
so the newcomer reads them back from there: its `job.losses` then covers the whole run, as
the lost process's would have (issue 31). The one step it cannot have: one the lost process
completed but died before logging (its state was restored from its peers; its loss was never
written anywhere).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..events import Ev


def recorded_losses(events_dir: Path, rank: int, upto: int) -> dict[int, float]:
    """Every loss a process recorded for `rank` at steps up to `upto`, from the event files;
    where a step was recorded more than once (recomputed after a rollback), the latest. A
    torn or foreign line is skipped: this is a record, not the state."""
    found: dict[int, tuple[float, float]] = {}  # step -> (time, loss)
    for path in sorted(Path(events_dir).glob("*.jsonl")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if not isinstance(e, dict) or e.get("event") != Ev.RANK_STEP or \
                    e.get("rank") != rank:
                continue
            step, loss, t = e.get("step"), e.get("loss"), e.get("t", 0.0)
            if not isinstance(step, int) or not isinstance(loss, (int, float)) or \
                    isinstance(loss, bool) or not 0 <= step <= upto:
                continue
            if step not in found or t >= found[step][0]:
                found[step] = (t, float(loss))
    return {step: loss for step, (_, loss) in found.items()}
