"""A rank that lost its controller connection: whether the controller is really gone (its
node, the batch host, died) and then the requeue of the job, which the ranks do themselves.
`Job.run` (job.py) asks this when the connection ends in a "controller connection lost"; a
watchdog asks it for a training thread that never gets there (stuck where the dead batch host
left it)."""
from __future__ import annotations

import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

from .. import protocol as P
from ..errors import HpctError
from ..events import Ev, EventLog
from ..slurm.env import SlurmEnv
from .client import ControllerAddress

if TYPE_CHECKING:
    from .standing import Standing


PEER_WITNESSES = 4  # other hosts a rank that lost its controller asks (settle)


def witnesses(a: P.Assign, not_hosts: set[str]) -> list[tuple[str, int]]:
    """Whom a rank that lost its controller asks whether it is the one cut off: one transfer
    server on each of up to PEER_WITNESSES other hosts (not this one, not the batch host),
    the nearest round the ring first. Distinct hosts: with several ranks a node, four
    neighbours are often one node, which may have died with the batch host."""
    chosen: dict[str, tuple[str, int]] = {}
    for r in sorted(a.peers, key=lambda r: (r - a.rank) % max(a.world_size, 1)):
        host = str(a.peers[r][0])
        if host not in not_hosts and host not in chosen:
            chosen[host] = a.peers[r]
            if len(chosen) == PEER_WITNESSES:
                break
    return list(chosen.values())


def main_thread_stack(frames: int = 12) -> list[str]:
    """The main thread's innermost Python frames, as `file:line function` (innermost last)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return [f"{f.filename}:{f.lineno} {f.name}"
            for f in traceback.extract_stack(frame)[-frames:]] if frame is not None else []


def _answers(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something listens at host:port: a connection, ended cleanly (_hang_up)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            _hang_up(s)
            return True
    except OSError:
        return False


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
                 slurm_client: Callable[[], Any] | None = None, grace_s: float = 15.0):
        self.controller, self.slurm, self.events = controller, slurm, events
        self.standing = standing
        self._slurm_client = slurm_client
        # How long the watchdog leaves the training thread to settle it (a collective it is
        # in waits out its timeout first).
        self.grace_s = grace_s
        self.probe_s = 3.0  # how long gone() tries the controller's port
        # How long a rank waits for Slurm to mark the batch host lost (its SlurmdTimeout, 300 s
        # by default, plus a ping), and how often it asks.
        self.verdict_s, self.verdict_every_s = 600.0, 2.0
        # Other nodes' transfer servers, (host, port), set at every adoption: the witnesses
        # that tell a dead batch host from this node cut off (peers_answer).
        self.peers: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._settled = False

    def settle(self, by: str = "rank") -> None:
        """Once per process, whichever thread comes first (the others wait for it). The job is
        requeued only when the controller is gone, another node answers, and Slurm has marked
        the batch host lost: then the batch host died. No node answering means this node is
        the one cut off; Slurm still hearing from the batch host means only the way between
        this node and it failed. Either way this rank leaves (its controller, if alive,
        replaces it), never requeueing a job that may be running fine without it: a requeue
        throws away every step since the last persisted one."""
        with self._lock:
            if self._settled:
                return
            self._settled = True
            if not self.gone():
                return
            if self.peers and not self.peers_answer():
                self.events.emit(Ev.RANK_ISOLATED, rank=self.standing.rank,
                                 peers=len(self.peers))
                return
            t0 = time.monotonic()
            host = self.batch_host_lost()
            if host is None:
                self.events.emit(Ev.RANK_BATCH_HOST_ALIVE, rank=self.standing.rank,
                                 waited_s=round(time.monotonic() - t0, 1))
                return
            self.requeue(by=by, batch_host=host, verdict_s=round(time.monotonic() - t0, 1))

    def batch_host_lost(self) -> str | None:
        """The batch host's name once Slurm has marked it lost (not responding, or down),
        asked every `verdict_every_s` for at most `verdict_s`; None if it never did, or the
        job left this incarnation meanwhile (another rank requeued it, or it ended)."""
        from ..slurm.client import SlurmClient

        slurm = (self._slurm_client or SlurmClient)()
        deadline = time.monotonic() + self.verdict_s
        while True:
            try:
                job = slurm.show_job(self.slurm.job_id)
                if not self._this_incarnation_runs(job):
                    return None
                if job.batch_host and slurm.show_node(job.batch_host).lost:
                    return job.batch_host
            except HpctError:
                pass  # slurmctld busy or out of reach: ask again
            if time.monotonic() + self.verdict_every_s > deadline:
                return None
            time.sleep(self.verdict_every_s)

    def peers_answer(self) -> bool:
        """Whether any other node's transfer server accepts a connection."""
        return any(_answers(host, port) for host, port in self.peers)

    def watch(self) -> None:
        """The connection ended without a Goodbye (CoordinationClient.on_lost). A training
        thread that is waiting or faulting settles it within `grace_s`; one that made no step
        meanwhile is stuck (seen on CI: every survivor of a batch host's loss sat in its step
        for minutes and no one requeued the job), and this thread settles it instead. One that
        keeps training leaves it for later: the job may still finish."""
        step = self.standing.step

        def run() -> None:
            time.sleep(self.grace_s)
            if self.standing.step == step and not self._settled:
                # where it sits, for whoever reads why the job was requeued from here
                self.events.emit(Ev.RANK_STUCK, rank=self.standing.rank, step=step,
                                 waited_s=self.grace_s, where=main_thread_stack())
                self.settle(by="watchdog")

        threading.Thread(target=run, daemon=True, name="hpct-controller-loss").start()

    def gone(self, probe_s: float | None = None) -> bool:
        """Whether the controller's listening socket is really gone (its host died), not just
        this connection (a rejected or broken stream): then, and only then, requeue."""
        addr = ControllerAddress.parse(self.controller)
        deadline = time.monotonic() + (self.probe_s if probe_s is None else probe_s)
        while time.monotonic() < deadline:
            if _answers(addr.host, addr.port):
                self.events.emit(Ev.RANK_CONTROLLER_ALIVE, rank=self.standing.rank)
                return False
            time.sleep(0.2)
        return True

    def requeue(self, by: str = "rank", **why: Any) -> None:
        """The controller is gone: its node (the batch host) died, and with it the job's batch
        script. Slurm keeps such a --no-kill job RUNNING on the other nodes, so the ranks
        requeue it themselves; the restarted job resumes from the last persisted snapshot,
        eligible at once rather than after Slurm's hold of about two minutes
        (SlurmClient.requeue). Lowest rank first; the others find the job already requeued and
        leave it alone. `by`: "watchdog" from a thread other than the main one, which cannot
        keep Slurm's SIGTERM off this process (sigterm_ignored): the requeue stands, but the
        early start may be lost with the process (the job then waits out Slurm's hold)."""
        from ..slurm.client import REQUEUE_BEGIN_S, SlurmClient, sigterm_ignored

        make = self._slurm_client or SlurmClient

        rank = self.standing.rank
        time.sleep(0.5 * max(rank, 0))
        slurm = make()

        def requeued() -> None:  # the outcome, before anything KillWait may cut short
            self.events.emit(Ev.RANK_REQUEUED_JOB, rank=rank, job_id=str(self.slurm.job_id),
                             reason="controller lost", by=by, **why)
        try:
            job = slurm.show_job(self.slurm.job_id)
            if not self._this_incarnation_runs(job):
                self.events.emit(Ev.RANK_REQUEUE_SKIPPED, rank=rank, state=job.state,
                                 restart_count=job.restart_count,
                                 why="the job left this run (requeued by another rank or by "
                                     "Slurm, or ended)")
                return
            # the requeue has Slurm signal this process and its scontrol: the command that
            # makes the job eligible early must outlive that, and so must the record, written
            # as soon as the requeue is done: Slurm's SIGTERM may come only after the update
            # (CI: the update landed 3 ms after the step's cancel, the record after it never
            # came), and ends this process once SIGTERM is no longer ignored.
            with sigterm_ignored():
                late = slurm.requeue(self.slurm.job_id, on_requeued=requeued)
            self.events.emit(Ev.RANK_REQUEUE_BEGIN, rank=rank,
                             **({"begin_error": late} if late else
                                {"begin_in_s": REQUEUE_BEGIN_S}))
        except HpctError as exc:
            if self._requeued_by_another(slurm):
                self.events.emit(Ev.RANK_REQUEUE_SKIPPED, rank=rank, error=exc.message,
                                 why="refused: the job was requeued meanwhile")
            else:
                self.events.emit(Ev.RANK_REQUEUE_FAILED, rank=rank, error=exc.message)

    def _this_incarnation_runs(self, job: Any) -> bool:
        """The job RUNNING and not requeued since this process started (no other rank's
        requeue, no Slurm requeue of its own)."""
        return job.state == "RUNNING" and job.restart_count == self.slurm.restart_count

    def _requeued_by_another(self, slurm: Any) -> bool:
        """A refused requeue after another rank's, whose probes ended sooner ("Job is pending
        execution"): not a failure."""
        try:
            return slurm.show_job(self.slurm.job_id).restart_count != self.slurm.restart_count
        except HpctError:
            return False
