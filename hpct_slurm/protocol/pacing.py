"""The pacing rule a rank follows when it reports its steps: the ranks' half of the
controller's pacing (controller/pacing.py), which hands every step its report interval
(HPCT_STEP_REPORT_S), and the kernel keepalives both ends put on their connection.

Both sides speak it, so it lives on their common floor: a rank's coordination client
(recovery/client.py) and the benchmark's simulated ranks apply it without importing the
controller. No I/O beyond socket options.
"""
from __future__ import annotations

import socket

# The controller's and the ranks' connections carry TCP keepalives: a node that died without
# a word (power, kernel, link) sends no FIN, stops answering the kernel's probes, and its
# connections fail after KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S (6 s),
# however long the heartbeat interval is, at no cost to an event loop. (A hung process on a
# live kernel still answers them: the controller waits for its silence timeout there.)
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 3, 1, 3


def should_report(step: int, generation: int, last: tuple[int, float] | None, now: float,
                  every_s: float) -> bool:
    """Whether a rank sends this step's StepDone. Always the first step of a generation (the
    controller ends a recovery round on it); otherwise every step when `every_s` is 0, else
    once `every_s` has passed since the last report (the controller only needs progress, and
    the heartbeat carries the step in between). `last`: (generation, time) of the last."""
    if every_s <= 0 or last is None or last[0] != generation:
        return True
    return now - last[1] >= every_s


def set_keepalive(sock: socket.socket | None, unacked_s: float | None = None) -> None:
    """Kernel keepalive probes on one connection (see KEEPALIVE_IDLE_S). `unacked_s`: also fail
    it once data sent on it has gone unacknowledged that long (TCP_USER_TIMEOUT). Keepalives
    only probe an idle connection; a side that keeps sending (a rank's heartbeats) would
    otherwise retransmit to a dead host for the kernel's ~15 minutes before its reads fail."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    options = [("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
               ("TCP_KEEPCNT", KEEPALIVE_COUNT)]
    if unacked_s is not None:
        options.append(("TCP_USER_TIMEOUT", int(unacked_s * 1000)))
    for name, value in options:
        if hasattr(socket, name):  # Linux; elsewhere the system defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
