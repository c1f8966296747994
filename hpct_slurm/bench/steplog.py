"""The one step record of `hpct-slurm bench peers` (issue 44): every system's script (ours:
adopted_inline.py with the call inserted by bench/peers.py's `script_text`; torchft's and
NVRx's in examples/peers/) calls `log_step` on the line right after its optimizer step, on
lines marked `# bench`. One function at one point of every
loop: no system's step is stamped earlier or later than another's (tests/test_bench_peers.py
checks the point). Also the start barrier the peers' first launch waits at.

The record is a `bench.step` event in the run dir's event logs (HPCT_RUN_DIR, what
`localcluster.jobs.submit` exports); without a run dir nothing is logged, so the scripts also
run on their own."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from .. import config as C
from ..events import Ev, EventLog

_log: EventLog | None = None
_STARTED = time.time()  # about when this process started: the scripts import this early


def _events() -> EventLog | None:
    global _log
    run_dir = C.read(None, C.RUN_DIR)
    if not run_dir:
        return None
    if _log is None:
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        _log = EventLog(Path(run_dir) / "events" / f"{node}-bench{os.getpid()}.jsonl",
                        source=f"{node}/bench")
    return _log


def log_step(rank: int, step: int, loss: float, world: int, committed: bool = True,
             generation: int | None = None) -> None:
    """One `bench.step` event: `rank` (the data shard it trained; -1 when it took no part)
    completed `step` in a group of `world` data-parallel participants. `generation`: the
    system's restart count (hpct-slurm's generation, NVRx in-process's restart iteration);
    by default torchelastic's TORCHELASTIC_RESTART_COUNT (NVRx in-job restarts; 0 on a
    spare's launcher). `started`: when the process started."""
    events = _events()
    if generation is None:
        generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if events is not None:
        events.emit(Ev.BENCH_STEP, rank=rank, step=step, loss=loss, world=world,
                    committed=committed, started=_STARTED, generation=generation)


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
