"""The real controller for `hpct-slurm bench scale`, in a process of its own (so that its CPU
seconds and RSS are its own): controller.Controller with its real code, protocol, secret and
policy, and two stand-ins at its seams, as in tests/test_controller_fast.py:

* `spawn_step` starts nothing (the simulated ranks connect from bench/scale_sim.py) and
  writes the first step environment it is given to <run_dir>/sim-env.json, so the simulated
  ranks get exactly what a real step would (address, secret file, pacing);
* the SlurmClient's `runner` answers without Slurm: no node's slurmd is reachable (a lost node
  is fenced DOWN at once), sinfo lists nothing lost, and every other command succeeds empty.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from pathlib import Path

from .. import config as C
from ..controller import controller as CTL
from ..slurm.client import SlurmClient
from .scale_sim import raise_fd_limit

_PIDS = itertools.count(900001)


class StandInStep:
    """What spawn_step returns: pid, stderr (ends when killed), wait(), kill()."""

    def __init__(self) -> None:
        self.pid = next(_PIDS)
        self.stderr = asyncio.StreamReader()
        self._done = asyncio.Event()

    async def wait(self) -> int:
        await self._done.wait()
        return 0

    def kill(self) -> None:
        self.stderr.feed_eof()
        self._done.set()


def runner(argv, **kwargs) -> subprocess.CompletedProcess:
    # matched by arguments, not by command name: commands are named only in hpct_slurm/slurm/
    argv = list(argv)
    if argv[1:3] == ["show", "node"]:
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="simulated: unreachable")
    if argv[1:2] == ["--json"]:  # the node list
        return subprocess.CompletedProcess(argv, 0, stdout='{"nodes": []}', stderr="")
    return subprocess.CompletedProcess(argv, 0, stdout="", stderr="")


def main() -> int:
    raise_fd_limit()
    cfg = json.loads(sys.argv[1])
    run_dir = Path(cfg["run_dir"])
    env_file = run_dir / "sim-env.json"
    wanted = (C.CONTROLLER_ADDR, C.SECRET_FILE, C.HEARTBEAT_S, C.STEP_REPORT_S, C.RELAY)

    async def spawn(node, role, argv, env, log):
        if not env_file.exists():
            tmp = env_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({k: env[k] for k in wanted if k in env}))
            tmp.rename(env_file)
        return StandInStep()

    opts = CTL.Options(command=["simulated"], run_dir=run_dir, job_id=int(cfg["job_id"]),
                       nodes=cfg["nodes"], batch_host=cfg["nodes"][0], spares=cfg["spares"],
                       tasks_per_node=cfg["tasks_per_node"], heartbeat_timeout_s=3.0,
                       ready_timeout_s=60.0, node_poll_s=5.0)
    ctl = CTL.Controller(opts, client=SlurmClient(runner=runner), spawn_step=spawn)
    if cfg.get("profile"):
        return asyncio.run(_profiled(ctl, Path(cfg["profile"])))
    return asyncio.run(ctl.run())


async def _profiled(ctl: CTL.Controller, path: Path) -> int:
    """Run under cProfile, its stats written every 2 s (the bench kills this process)."""
    import cProfile

    prof = cProfile.Profile()

    async def dump() -> None:
        while True:
            await asyncio.sleep(2.0)
            prof.dump_stats(path)  # (which disables the profiler)
            prof.enable()

    task = asyncio.create_task(dump())
    prof.enable()
    try:
        return await ctl.run()
    finally:
        task.cancel()


if __name__ == "__main__":
    sys.exit(main())
