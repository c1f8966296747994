"""Simulated ranks for `hpct-slurm bench scale`: many light asyncio clients in one process,
each speaking the real protocol (protocol.Channel, the job's secret) to the real controller,
with the heartbeat and step-report intervals the controller put in its step environment.

What a rank does is what recovery/job.py does, minus training: register, heartbeat, one step
every `step_s` (StepDone paced like recovery/client.py), answer a STOP with Holdings and a
`ready` heartbeat, answer an Assign with an immediate heartbeat (its acknowledgement), leave
on Goodbye. Faults, on command: `drop` aborts every connection of a node (the controller sees
resets: a crashed node), `silent` makes a node's ranks stop sending and stop answering while
their connections stay open (a hung or partitioned node, no EOF).

Driven over stdin/stdout, one JSON object a line (bench/scale.py is the driver):
  in:  {"cmd": "drop"|"silent", "node": N} | {"cmd": "status"} | {"cmd": "count", "on": bool}
  out: {"status": {...}} answers; {"ready": true} once every rank registered.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import sys
import time
from collections import Counter

from .. import config as C
from .. import protocol as P
from ..controller.pacing import should_report

# Connections being opened at once by one process: the controller drops the oldest
# unregistered connection beyond 256 (controller.MAX_UNREGISTERED).
CONNECTING = 192


def raise_fd_limit() -> int:
    """Soft open-files limit up to the hard one, for this process only."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class Sim:
    def __init__(self, cfg: dict):
        self.job = str(cfg["job_id"])
        env = cfg["env"]  # the controller's step environment (the real ranks' contract)
        host, _, port = C.require(env, C.CONTROLLER_ADDR).rpartition(":")
        self.address = (host, int(port))
        self.secret = P.load_secret(C.require(env, C.SECRET_FILE))
        self.heartbeat_s = C.read(env, C.HEARTBEAT_S)
        self.report_s = C.read(env, C.STEP_REPORT_S) or 0.0
        self.step_s = float(cfg["step_s"])
        self.tpn = int(cfg["tasks_per_node"])
        self.nodes: list[tuple[str, str]] = [tuple(x) for x in cfg["nodes"]]  # (name, role)
        self.ranks: list[Rank] = []
        self.sent: Counter = Counter()
        self.counting = False
        # all simulators together stay under the controller's cap on unregistered connections
        self.connect_gate = asyncio.Semaphore(max(1, CONNECTING // int(cfg.get("sims", 1))))

    def note(self, kind: str) -> None:
        if self.counting:
            self.sent[kind] += 1

    async def main(self) -> None:
        port = 20000
        for node, role in self.nodes:
            for lr in range(self.tpn):
                self.ranks.append(Rank(self, node, lr, role, port))
                port += 1
        await asyncio.gather(*(r.start() for r in self.ranks))
        out({"ready": True, "ranks": len(self.ranks)})
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["cmd"] in ("drop", "silent"):
                for r in self.ranks:
                    if r.node == cmd["node"]:
                        r.fail(cmd["cmd"])
            elif cmd["cmd"] == "count":
                self.counting = bool(cmd["on"])
                if self.counting:
                    self.sent.clear()
            elif cmd["cmd"] == "status":
                out({"status": self.status()})

    def status(self) -> dict:
        gens: dict[int, list[float]] = {}
        stops: dict[int, list[float]] = {}
        for r in self.ranks:
            for g, t in r.assigned.items():
                gens.setdefault(g, []).append(t)
            for g, t in r.stopped.items():
                stops.setdefault(g, []).append(t)
        return {"registered": sum(r.registered for r in self.ranks),
                "assigned": {g: [len(ts), max(ts)] for g, ts in gens.items()},
                "stopped": {g: [len(ts), max(ts)] for g, ts in stops.items()},
                "sent": dict(self.sent)}


class Rank:
    def __init__(self, sim: Sim, node: str, local_rank: int, role: str, port: int):
        self.sim, self.node, self.local_rank, self.role, self.port = (
            sim, node, local_rank, role, port)
        self.rank = self.generation = self.step = -1
        self.state = "registering"
        self.registered = False
        self.mute = False
        self.assigned: dict[int, float] = {}  # generation -> when its Assign arrived
        self.stopped: dict[int, float] = {}   # generation -> when its Stop arrived
        self.last_report: tuple[int, float] | None = None
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        s = self.sim
        async with s.connect_gate:
            deadline = time.monotonic() + 300  # a busy controller accepts slowly
            while time.monotonic() < deadline:
                try:
                    self.reader, self.writer = await asyncio.open_connection(*s.address)
                    self.chan = await P.client_hello_async(self.reader, s.secret, s.job)
                    break
                except (OSError, P.ProtocolError, asyncio.IncompleteReadError):
                    await asyncio.sleep(0.1 + random.random() * 0.2)
            else:
                raise SystemExit(f"{self.node}/{self.local_rank}: cannot reach the controller")
            await self.send(P.Register(s.job, self.node, self.local_rank, self.role,
                                       os.getpid(), "127.0.0.1", self.port), "register")
            self.registered = True
        self.tasks = [asyncio.create_task(self.read()), asyncio.create_task(self.beat()),
                      asyncio.create_task(self.train())]

    async def send(self, msg, kind: str) -> None:
        if self.mute:
            return
        try:
            await self.chan.write(self.writer, msg)
            self.sim.note(kind)
        except (OSError, ConnectionError):
            self.mute = True

    async def heartbeat(self) -> None:
        await self.send(P.Heartbeat(self.rank, self.generation, self.step, self.state),
                        "heartbeat")

    async def beat(self) -> None:
        # a random phase: real ranks start at different moments
        await asyncio.sleep(random.random() * self.sim.heartbeat_s)
        while not self.mute:
            await self.heartbeat()
            await asyncio.sleep(self.sim.heartbeat_s)

    async def train(self) -> None:
        while not self.mute:
            await asyncio.sleep(self.sim.step_s)
            if self.state != "running":
                continue
            self.step += 1
            now = time.monotonic()
            if should_report(self.step, self.generation, self.last_report, now,
                             self.sim.report_s):
                self.last_report = (self.generation, now)
                await self.send(P.StepDone(self.rank, self.generation, self.step), "step_done")

    async def read(self) -> None:
        try:
            while True:
                msg = (await self.chan.read(self.reader)).msg
                if self.mute:
                    continue  # silent: reads (the kernel would buffer anyway), never answers
                if isinstance(msg, P.Assign):
                    self.assigned[msg.generation] = time.time()
                    self.rank, self.generation = msg.rank, msg.generation
                    self.step, self.state = msg.restore_step, "running"
                    await self.heartbeat()  # the acknowledgement
                elif isinstance(msg, P.Stop):
                    self.stopped[msg.generation] = time.time()
                    self.state = "ready"
                    own = [s for s in (self.step - 1, self.step) if s >= 0]
                    await self.send(P.Holdings(self.rank, self.generation, "jit", False, own,
                                               [], {}), "holdings")
                    await self.heartbeat()
                elif isinstance(msg, P.Goodbye):
                    self.fail("drop")
                    return
        except (P.ProtocolError, OSError, ConnectionError, asyncio.IncompleteReadError) as exc:
            if not self.mute:
                print(f"{self.node}/{self.local_rank}: controller connection failed: {exc}",
                      file=sys.stderr)
            self.mute = True

    def fail(self, how: str) -> None:
        self.mute = True
        if how == "drop":
            for t in self.tasks:
                if t is not asyncio.current_task():
                    t.cancel()
            self.writer.transport.abort()


def out(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    raise_fd_limit()
    cfg = json.loads(sys.argv[1])
    asyncio.run(Sim(cfg).main())


if __name__ == "__main__":
    main()
