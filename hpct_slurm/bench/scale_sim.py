"""Simulated nodes for `hpct-slurm bench scale`: many light asyncio clients in one process,
each speaking the real protocol (protocol.Channel, the job's secret) to the real controller,
with the heartbeat and step-report intervals the controller put in its step environment.

Nodes of 8 ranks: the controller sets HPCT_RELAY for them, so each simulated node is what
relay/node.py makes of a real one: one connection opened with a RelayHello, its ranks'
messages going up in Batch frames as the relay's own Coalescer (relay/coalesce.py)
decides, and the controller's Batch fanned out to the ranks. What a rank does is what
recovery/job.py does, minus training: register, heartbeat, one step every `step_s`
(StepDone paced like recovery/client.py), answer a STOP with Holdings and a `ready`
heartbeat, answer an Assign with a heartbeat (its acknowledgement: a routine one, which goes up
with the node's next flush), leave on Goodbye. Faults, on command: `drop` aborts a node's connection (the controller sees a reset: a
crashed node), `silent` makes a node stop sending and stop answering while its connection
stays open (a hung or partitioned node, no EOF).

Driven over stdin/stdout, one JSON object a line (bench/scale.py is the driver):
  in:  {"cmd": "drop"|"silent", "node": N} | {"cmd": "status"} | {"cmd": "count", "on": bool}
  out: {"status": {...}} answers; {"ready": true} once every rank registered.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections import Counter

from .. import config as C
from .. import protocol as P
from ..controller.pacing import should_report
from ..fdlimit import raise_nofile
from ..relay.coalesce import Coalescer

# Connections being opened at once by one process: the controller drops the oldest
# unregistered connection beyond 256 (controller.MAX_UNREGISTERED).
CONNECTING = 192


def raise_fd_limit() -> int:
    """Soft open-files limit up to the hard one, for this process only (fdlimit.py, as the
    ranks and the controller do); the soft limit it leaves."""
    return raise_nofile()[1]


class Sim:
    def __init__(self, cfg: dict):
        self.job = str(cfg["job_id"])
        env = cfg["env"]  # the controller's step environment (the real ranks' contract)
        if not C.read(env, C.RELAY):
            raise SystemExit("the controller did not relay these nodes (HPCT_RELAY unset)")
        host, _, port = C.require(env, C.CONTROLLER_ADDR).rpartition(":")
        self.address = (host, int(port))
        self.secret = P.load_secret(C.require(env, C.SECRET_FILE))
        self.heartbeat_s = C.read(env, C.HEARTBEAT_S)
        self.report_s = C.read(env, C.STEP_REPORT_S) or 0.0
        self.step_s = float(cfg["step_s"])
        self.tpn = int(cfg["tasks_per_node"])
        self.nodes: list[Node] = []
        self.specs: list[tuple[str, str]] = [tuple(x) for x in cfg["nodes"]]  # (name, role)
        self.sent: Counter = Counter()
        self.counting = False
        # all simulators together stay under the controller's cap on unregistered connections
        self.connect_gate = asyncio.Semaphore(max(1, CONNECTING // int(cfg.get("sims", 1))))

    def note(self, pairs: list) -> None:
        if self.counting:
            self.sent["frame"] += 1
            self.sent.update(m.TYPE for _, m in pairs)

    async def main(self) -> None:
        port = 20000
        for node, role in self.specs:
            self.nodes.append(Node(self, node, role, port))
            port += self.tpn
        await asyncio.gather(*(n.start() for n in self.nodes))
        out({"ready": True, "ranks": len(self.nodes) * self.tpn})
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["cmd"] in ("drop", "silent"):
                for n in self.nodes:
                    if n.name == cmd["node"]:
                        n.fail(cmd["cmd"])
            elif cmd["cmd"] == "count":
                self.counting = bool(cmd["on"])
                if self.counting:
                    self.sent.clear()
            elif cmd["cmd"] == "status":
                out({"status": self.status()})

    def status(self) -> dict:
        gens: dict[int, list[float]] = {}
        stops: dict[int, list[float]] = {}
        for n in self.nodes:
            for r in n.ranks:
                for g, t in r.assigned.items():
                    gens.setdefault(g, []).append(t)
                for g, t in r.stopped.items():
                    stops.setdefault(g, []).append(t)
        return {"registered": sum(n.registered for n in self.nodes) * self.tpn,
                "assigned": {g: [len(ts), max(ts)] for g, ts in gens.items()},
                "stopped": {g: [len(ts), max(ts)] for g, ts in stops.items()},
                "sent": dict(self.sent)}


class Rank:
    """One simulated rank's state (its node does the talking)."""

    def __init__(self, local_rank: int):
        self.local_rank = local_rank
        self.rank = self.generation = self.step = -1
        self.state = "registering"
        self.assigned: dict[int, float] = {}  # generation -> when its Assign arrived
        self.stopped: dict[int, float] = {}   # generation -> when its Stop arrived
        self.last_report: tuple[int, float] | None = None

    def heartbeat(self) -> P.Heartbeat:
        return P.Heartbeat(self.rank, self.generation, self.step, self.state)


class Node:
    """One simulated node: its relay's connection and its ranks."""

    def __init__(self, sim: Sim, name: str, role: str, port: int):
        self.sim, self.name, self.role, self.port = sim, name, role, port
        self.ranks = [Rank(lr) for lr in range(sim.tpn)]
        self.co = Coalescer(sim.heartbeat_s)
        self.registered = False
        self.mute = False
        self.flush_at: asyncio.TimerHandle | None = None
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
                raise SystemExit(f"{self.name}: cannot reach the controller")
            self.writer.write(self.chan.encode(P.RelayHello(s.job, self.name, self.role,
                                                            os.getpid())))
            for r in self.ranks:
                self.add(r, P.Register(s.job, self.name, r.local_rank, self.role,
                                       os.getpid(), "127.0.0.1", self.port + r.local_rank))
            await self.writer.drain()
            self.registered = True
        self.tasks = [asyncio.create_task(self.read()), asyncio.create_task(self.beat()),
                      asyncio.create_task(self.train())]

    def add(self, rank: Rank, msg) -> None:
        """A rank's message, to the node's relay (what its connection to it would carry)."""
        if self.mute:
            return
        now = time.monotonic()
        self.co.add(rank.local_rank, msg, now)
        wait = self.co.wait_s(now)
        if wait == 0.0:
            self.flush()
        elif wait is not None and self.flush_at is None:
            self.flush_at = asyncio.get_running_loop().call_later(wait, self.flush)

    def flush(self) -> None:
        if self.flush_at is not None:
            self.flush_at.cancel()
            self.flush_at = None
        if self.mute:
            return
        now = time.monotonic()
        if not self.co.due(now):
            wait = self.co.wait_s(now)
            if wait is not None:
                self.flush_at = asyncio.get_running_loop().call_later(wait, self.flush)
            return
        pairs = self.co.take(now)
        try:
            self.writer.write(b"".join(self.chan.encode_batch(pairs)))
            self.sim.note(pairs)
        except (OSError, ConnectionError):
            self.mute = True

    async def beat(self) -> None:
        # a random phase: real nodes start at different moments
        await asyncio.sleep(random.random() * self.sim.heartbeat_s)
        while not self.mute:
            for r in self.ranks:
                self.add(r, r.heartbeat())
            await asyncio.sleep(self.sim.heartbeat_s)

    async def train(self) -> None:
        while not self.mute:
            await asyncio.sleep(self.sim.step_s)
            now = time.monotonic()
            for r in self.ranks:
                if r.state != "running":
                    continue
                r.step += 1
                if should_report(r.step, r.generation, r.last_report, now, self.sim.report_s):
                    r.last_report = (r.generation, now)
                    self.add(r, P.StepDone(r.rank, r.generation, r.step))

    async def read(self) -> None:
        try:
            while True:
                batch = (await self.chan.read(self.reader)).msg
                if self.mute:
                    continue  # silent: reads (the kernel would buffer anyway), never answers
                for lr, msg in batch.messages():
                    r = self.ranks[lr]
                    if isinstance(msg, P.Assign):
                        r.assigned[msg.generation] = time.time()
                        r.rank, r.generation = msg.rank, msg.generation
                        r.step, r.state = msg.restore_step, "running"
                        self.add(r, r.heartbeat())  # the acknowledgement
                    elif isinstance(msg, P.Stop):
                        r.stopped[msg.generation] = time.time()
                        r.state = "ready"
                        own = [s for s in (r.step - 1, r.step) if s >= 0]
                        self.add(r, P.Holdings(r.rank, r.generation, "jit", False, own, [], {}))
                        self.add(r, r.heartbeat())
                    elif isinstance(msg, P.Goodbye):
                        self.fail("drop")
                        return
        except (P.ProtocolError, OSError, ConnectionError, asyncio.IncompleteReadError) as exc:
            if not self.mute:
                print(f"{self.name}: controller connection failed: {exc}", file=sys.stderr)
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
