"""The job's steps: one `srun -N1 -w node` step per node, as the controller starts, watches,
waits for and cancels them.

`Steps` builds a step's environment (what a rank needs to find and trust the controller),
launches the step (spawn_srun, or a test's stand-in), reads its stderr for srun's "Node
failure on" line and the script's last error, and turns an exit it did not cause into a fault
(or, before the job completed any step, into a start-up failure that may be the script's own).
At the end it waits for the steps and kills what is left; fencing cancels one node's steps.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .. import config as C
from ..errors import HpctError
from ..events import Ev, EventLog
from ..slurm.client import SlurmClient, SlurmCommandError, srun_argv
from .options import Options
from .pacing import Pacing
from .policy import World

if TYPE_CHECKING:
    from .failslow import FailSlow

NODE_FAILURE_RE = re.compile(r"Node failure on (\S+)")
# The last line of a Python traceback (`FileNotFoundError: ...`), or an hpct error line.
ERROR_LINE_RE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt)\b|^HPCT: ")


async def spawn_srun(node: str, role: str, argv: list[str], env: dict[str, str],
                     log) -> asyncio.subprocess.Process:
    """Start one node's job step: `argv` (an `srun -N1 -w node ...` line) as a subprocess,
    stdout into the node's log file `log`, stderr piped (the controller reads srun's "Node
    failure on" line and the script's last error from it). The controller's default step
    launcher; see Controller's `spawn_step`."""
    return await asyncio.create_subprocess_exec(
        *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log,
        stderr=asyncio.subprocess.PIPE)


# (node, role, argv, env, log) -> a started step: what spawn_srun returns, or a stand-in with
# `pid`, `stderr` (an async iterable of byte lines), `wait()` (a coroutine: the exit code) and
# `kill()`.
StepSpawner = Callable[[str, str, list[str], dict[str, str], Any], Awaitable[Any]]


class Steps:
    """The controller's job steps (a piece of Controller, controller.py)."""

    # The controller's state this piece reads and writes (Controller.__init__ sets it up).
    o: Options
    slurm: SlurmClient
    spawn_step: StepSpawner
    run_dir: Path
    secret_path: Path
    address: tuple[str, int]
    events: EventLog
    world: World
    pacing: Pacing
    relayed: bool
    data_world: int
    failslow: "FailSlow"
    steps: dict[str, asyncio.subprocess.Process]
    heard_from: set[str]
    dead_nodes: set[str]
    expected_exits: set[int]  # pids of steps we cancelled ourselves
    borrowed: list[int]
    pool_nodes: set[str]
    trained: bool
    start_failures: dict[str, str]
    last_error: dict[str, str]
    finished: asyncio.Event
    # What it passes on to the other pieces: _fault (detection.py), _escalate (ending.py).

    def _step_env(self, role: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            C.CONTROLLER_ADDR: f"{self.address[0]}:{self.address[1]}",
            C.SECRET_FILE: str(self.secret_path),
            C.RUN_DIR: str(self.run_dir),
            C.ROLE: role,
            C.STORE: self.o.store,
            # the controller is the one writer of the ranks' timeouts (a task prolog leaves
            # them alone: hooks/task_prolog.CONTROLLER_OWNED)
            C.COLLECTIVE_TIMEOUT_S: str(self.o.collective_timeout_s),
            C.INIT_TIMEOUT_S: str(self.o.init_timeout_s),
            # what a first step after a formation may wait in a collective (Generation.form)
            C.PROGRESS_TIMEOUT_S: str(self.o.progress_timeout_s),
            C.PERSIST_EVERY: str(self.o.persist_every),
            # the data-parallel world, for a DistributedSampler built before job.run
            C.WORLD_SIZE: str(self.data_world),
            # the window a rank's own time per step is the median over (fail-slow)
            C.SLOW_WINDOW: str(self.failslow.window),
        })
        env.update(self.pacing.env())
        if self.relayed:
            env[C.RELAY] = "1"
        return env

    def _launch(self, node: str, role: str) -> None:
        self.heard_from.discard(node)
        env = self._step_env(role)
        argv = srun_argv(node, self.o.command, ntasks=self.o.tasks_per_node,
                         job_id=self.o.job_id,
                         extra_opts=["--overlap", "--kill-on-bad-exit=0", "-u",
                                     f"--job-name=hpct-{role}-{node}", "--cpus-per-task=1"])
        log = open(self.run_dir / "logs" / f"{node}.out", "ab")
        proc_task = asyncio.create_task(self._run_step(node, role, argv, env, log))
        proc_task.add_done_callback(lambda t: log.close())
        self.events.emit(Ev.STEP_LAUNCH, node=node, role=role)

    async def _run_step(self, node: str, role: str, argv: list[str], env: dict, log) -> None:
        proc = await self.spawn_step(node, role, argv, env, log)
        self.steps[node] = proc
        assert proc.stderr is not None
        async for raw in proc.stderr:
            log.write(raw)
            log.flush()
            line = raw.decode(errors="replace")
            m = NODE_FAILURE_RE.search(line)
            if m:
                self._fault(m.group(1), "srun: node failure")
            elif ERROR_LINE_RE.match(line):
                self.last_error[node] = line.strip()[:500]
        rc = await proc.wait()
        if self.steps.get(node) is proc:
            del self.steps[node]
        self.events.emit(Ev.STEP_EXIT, node=node, role=role, code=rc,
                         error=self.last_error.get(node, "") if rc else "")
        if rc and not self.trained and not self.finished.is_set() \
                and proc.pid not in self.expected_exits:
            self._start_failure(node, rc)
        if not self.finished.is_set() and node not in self.dead_nodes \
                and proc.pid not in self.expected_exits:
            # srun's exit code on a node failure is 0 in Slurm 22.05 and 1 in 24.11 and
            # 26.05: never read it; any exit while training runs is a fault.
            if node in self.world.members or node in self.world.spares:
                self._fault(node, f"step exited ({rc})")

    def _start_failure(self, node: str, rc: int) -> None:
        """A step that failed before the job completed any step. On one node that may be the
        node (it is replaced like any fault); the same error from two nodes is the script's:
        every replacement would fail the same way and a requeue would run it again, so the
        job ends with that error."""
        error = self.last_error.get(node) or f"exit code {rc}"
        self.start_failures[node] = error
        same = [n for n, e in self.start_failures.items() if e == error]
        if len(same) >= min(2, len(self.world.members) + len(self.world.spares)):
            asyncio.ensure_future(self._escalate(
                f"the training command failed before its first step on {', '.join(same)}: "
                f"{error}", script=True))

    async def _stop_steps(self, grace: float = 15.0) -> None:
        # A step none of whose ranks registered (a spare relaunched moments before the end,
        # still importing torch) holds nothing and hears no Goodbye: ended now, not waited
        # for (it held every such job's end for the whole grace, 15 s).
        for node, proc in list(self.steps.items()):
            if node not in self.heard_from:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        deadline = time.monotonic() + grace
        for proc in list(self.steps.values()):
            with contextlib.suppress(asyncio.TimeoutError, ProcessLookupError):
                await asyncio.wait_for(proc.wait(), max(0.1, deadline - time.monotonic()))
        for proc in list(self.steps.values()):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def _cancel_steps_on(self, node: str) -> None:
        """Cancel what runs of this job on `node` (off the loop: it waits for Slurm): its
        numbered steps, or, on a node lent by the pool, the companion job that lent it."""
        if node in self.pool_nodes:
            for job in self.borrowed:
                with contextlib.suppress(SlurmCommandError):
                    info = self.slurm.show_job(job)
                    if node in info.nodelist:
                        self.slurm.cancel(job, signal="KILL")
            return
        try:
            steps = self.slurm.job_steps(self.o.job_id)
        except HpctError:
            return
        for step in steps:
            # only numbered steps: the batch step ("J.batch") is this controller itself
            if step.nodelist == [node] and step.numbered:
                with contextlib.suppress(SlurmCommandError):
                    self.slurm.cancel(self.o.job_id, int(step.step), signal="KILL")
