"""Health checks a rank runs before it rejoins: CPU always, CUDA when a GPU is present.

A CUDA context that hit an error can hang in synchronize(); the check runs it in a thread
with a deadline so a broken device fails the check instead of hanging the rank.
"""
from __future__ import annotations

import threading

import torch


def cpu_check() -> tuple[bool, str]:
    a = torch.arange(64, dtype=torch.float64)
    ok = float((a * 2).sum()) == 4032.0
    return ok, "cpu ok" if ok else "cpu arithmetic check failed"


def cuda_check(timeout_s: float = 10.0) -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return True, "no cuda"
    result: list[tuple[bool, str]] = []

    def probe() -> None:
        try:
            x = torch.ones(1024, device="cuda")
            total = float(x.sum())
            torch.cuda.synchronize()
            result.append((total == 1024.0, f"cuda ok ({torch.cuda.get_device_name()})"))
        except Exception as exc:  # any CUDA error means unhealthy, never a crash
            result.append((False, f"cuda error: {exc}"))

    t = threading.Thread(target=probe, daemon=True, name="hpct-cuda-health")
    t.start()
    t.join(timeout_s)
    if not result:
        return False, f"cuda synchronize did not return within {timeout_s:.0f} s"
    return result[0]


def health_check() -> tuple[bool, str]:
    details = []
    for check in (cpu_check, cuda_check):
        ok, detail = check()
        details.append(detail)
        if not ok:
            return False, detail
    return True, "; ".join(details)
