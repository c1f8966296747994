"""Where a rank's fault was raised, for whoever reads why its job failed (issue 45.4): the
`where` of its `rank.fault` event, and the full traceback in the rank's log
(`<run dir>/logs/<node>.out`, which docs/troubleshooting.md points to).

An error from deep inside torch (a layer called with the wrong shape) has only torch's frames
among its innermost ones; the line of the training script that led there is what its author
needs. So `where` is the innermost frames and, when it is not among them, the script's own
innermost frame: the innermost one outside torch, hpct-slurm and Python's standard library
(hpct-slurm's examples are scripts)."""
from __future__ import annotations

import os
import sys
import sysconfig
import time
import traceback
from pathlib import Path

import torch

import hpct_slurm

_EXAMPLES = str(Path(hpct_slurm.__file__).parent / "examples") + os.sep
_LIBRARIES = tuple(str(Path(p)) + os.sep for p in {
    Path(torch.__file__).parent, Path(hpct_slurm.__file__).parent,
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})


def scripts_frame(frame: traceback.FrameSummary) -> bool:
    """Whether `frame` is the training script's (or its own modules'), not a library's."""
    name = os.path.abspath(frame.filename)
    if frame.filename.startswith("<"):  # <frozen ...>, <string>
        return False
    return name.startswith(_EXAMPLES) or not name.startswith(_LIBRARIES)


def where(exc: BaseException, frames: int = 4) -> str:
    """Its innermost frames, innermost first (`file:line in fn`), then the script's own
    innermost frame if it is not among them."""
    tb = traceback.extract_tb(exc.__traceback__)
    shown = list(reversed(tb[-frames:]))
    script = next((f for f in reversed(tb) if scripts_frame(f)), None)
    if script is not None and script not in shown:
        shown += [None, script]
    return " < ".join("..." if f is None else f"{Path(f.filename).name}:{f.lineno} in {f.name}"
                      for f in shown)


def log(exc: BaseException) -> None:
    """The full traceback into the rank's log (its step's output), the job recovering or not:
    written to stdout, which the controller keeps in `logs/<node>.out` (stderr is read for the
    step's last error line, which a fault the job survives must not become)."""
    try:
        print(f"HPCT {time.strftime('%Y-%m-%d %H:%M:%S')}: a fault ended this rank's "
              f"generation (its rank.fault event says what became of it):", flush=False)
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stdout)
        sys.stdout.flush()
    except (OSError, ValueError):  # stdout closed or gone: the event still says where
        pass


def record(exc: BaseException, frames: int = 4) -> str:
    """`log` the fault and return its `where`."""
    log(exc)
    return where(exc, frames)
