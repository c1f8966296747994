"""A rank that lost its controller connection: whether the controller is really gone (its
node, the batch host, died) and then the requeue of the job, which the ranks do themselves.
`Job.run` (job.py) asks this when the connection ends in a "controller connection lost"."""
from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any, Callable

from ..errors import HpctError
from ..events import Ev, EventLog
from ..slurm.env import SlurmEnv
from .client import ControllerAddress

if TYPE_CHECKING:
    from .generation import Standing


def _hang_up(s: socket.socket) -> None:
    """End a probe cleanly: say we are done and read what the controller sent (its hello)
    until it closes. Closing with that hello unread makes the kernel reset the connection,
    which the controller logs as `protocol.rejected`, the event meant for strangers."""
    try:
        s.shutdown(socket.SHUT_WR)
        s.settimeout(0.5)
        while s.recv(4096):
            pass
    except OSError:
        pass


class ControllerLoss:
    """`controller`: the controller's address as the rank was given it ($HPCT_CONTROLLER);
    `slurm`: this job's SLURM_*; `slurm_client` makes the Slurm client that requeues (the
    real `SlurmClient` unless a test passes a fake)."""

    def __init__(self, controller: str, slurm: SlurmEnv, events: EventLog, standing: Standing,
                 slurm_client: Callable[[], Any] | None = None):
        self.controller, self.slurm, self.events = controller, slurm, events
        self.standing = standing
        self._slurm_client = slurm_client

    def gone(self, probe_s: float = 3.0) -> bool:
        """Whether the controller's listening socket is really gone (its host died), not just
        this connection (a rejected or broken stream): then, and only then, requeue."""
        addr = ControllerAddress.parse(self.controller)
        deadline = time.monotonic() + probe_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((addr.host, addr.port), timeout=1.0) as s:
                    self.events.emit(Ev.RANK_CONTROLLER_ALIVE, rank=self.standing.rank)
                    _hang_up(s)
                    return False
            except OSError:
                time.sleep(0.2)
        return True

    def requeue(self) -> None:
        """The controller is gone: its node (the batch host) died, and with it the job's batch
        script. Slurm keeps such a --no-kill job RUNNING on the other nodes, so the ranks
        requeue it themselves; the restarted job resumes from the last persisted snapshot,
        eligible at once rather than after Slurm's hold of about two minutes
        (SlurmClient.requeue). Lowest rank first; the others find the job already requeued and
        leave it alone."""
        from ..slurm.client import REQUEUE_BEGIN_S, SlurmClient, sigterm_ignored

        make = self._slurm_client or SlurmClient

        rank = self.standing.rank
        time.sleep(0.5 * max(rank, 0))
        slurm = make()
        try:
            job = slurm.show_job(self.slurm.job_id)
            if job.state == "RUNNING" and job.restart_count == self.slurm.restart_count:
                # the requeue has Slurm signal this process and its scontrol at once: the
                # command that makes the job eligible early must outlive that
                with sigterm_ignored():
                    late = slurm.requeue(self.slurm.job_id)
                self.events.emit(Ev.RANK_REQUEUED_JOB, rank=rank, job_id=str(self.slurm.job_id),
                                 reason="controller lost",
                                 **({"begin_error": late} if late else
                                    {"begin_in_s": REQUEUE_BEGIN_S}))
        except HpctError as exc:
            self.events.emit(Ev.RANK_REQUEUE_FAILED, rank=rank, error=exc.message)
