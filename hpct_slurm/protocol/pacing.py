"""The pacing rule a rank follows when it reports its steps: the ranks' half of the
controller's pacing (controller/pacing.py), which hands every step its report interval
(HPCT_STEP_REPORT_S).

Both sides speak it, so it lives on their common floor: a rank's coordination client
(recovery/client.py) and the benchmark's simulated ranks apply it without importing the
controller. Pure, no I/O.
"""
from __future__ import annotations


def should_report(step: int, generation: int, last: tuple[int, float] | None, now: float,
                  every_s: float) -> bool:
    """Whether a rank sends this step's StepDone. Always the first step of a generation (the
    controller ends a recovery round on it); otherwise every step when `every_s` is 0, else
    once `every_s` has passed since the last report (the controller only needs progress, and
    the heartbeat carries the step in between). `last`: (generation, time) of the last."""
    if every_s <= 0 or last is None or last[0] != generation:
        return True
    return now - last[1] >= every_s
