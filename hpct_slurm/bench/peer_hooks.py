"""What the peers' adopted scripts (hpct_slurm/examples/peers/) call for the benchmark alone,
on lines marked `# bench`: a `rank.step` event per completed step in the run dir's event logs
(the record hpct-slurm's own ranks write, read by the same yardstick), and a start barrier.

The run dir is HPCT_RUN_DIR (what `localcluster.jobs.submit` exports); without it, nothing is
logged, so the scripts also run on their own."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from .. import config as C
from ..events import Ev, EventLog

_log: EventLog | None = None
_STARTED = time.time()  # about when this process started: the scripts import this first


def _events() -> EventLog | None:
    global _log
    run_dir = C.read(None, C.RUN_DIR)
    if not run_dir:
        return None
    if _log is None:
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        _log = EventLog(Path(run_dir) / "events" / f"{node}-peer{os.getpid()}.jsonl",
                        source=f"{node}/peer")
    return _log


def log_step(rank: int, step: int, loss: float, world: int, committed: bool = True) -> None:
    """One `rank.step` event: `rank` completed `step` in a group of `world` data-parallel
    participants. `generation` is the launcher's restart count (torchelastic's
    TORCHELASTIC_RESTART_COUNT: NVRx's in-job restarts; 0 on a spare's launcher), `started`
    when the process started."""
    events = _events()
    if events is not None:
        events.emit(Ev.RANK_STEP, rank=rank, step=step, loss=loss, world=world,
                    committed=committed, started=_STARTED,
                    generation=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def start_barrier(rank: int, world: int, timeout: float = 300.0) -> None:
    """The first launch of every rank waits here until all `world` ranks arrived (a file per
    rank under the run dir), so that a fault-free run starts at full world size every time;
    a relaunched rank (its file is there already) goes straight on."""
    run_dir = C.read(None, C.RUN_DIR)
    if not run_dir:
        return
    d = Path(run_dir) / "start-barrier"
    d.mkdir(parents=True, exist_ok=True)
    mine = d / f"rank{rank}"
    if mine.exists():
        return
    mine.touch()
    deadline = time.monotonic() + timeout
    while len(list(d.iterdir())) < world and time.monotonic() < deadline:
        time.sleep(0.05)
