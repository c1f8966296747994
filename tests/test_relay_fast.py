"""Issue 16 part 2, fast tier: a node's ranks behind one relay (relay/node.py).

The pure part (coalesce.Coalescer: what a relay forwards, and when) with times passed in; then
the real Controller (test_controller_fast's FakeCluster: stand-ins only at its Slurm and step
seams) against nodes of several ranks, each node running the real NodeRelay and each rank the
real CoordinationClient (recovery/client.py, its threads and blocking sockets), driven the way
recovery/job.py drives it: a round through the relays, a relay lost in the middle of a round,
and one rank lost while its node's relay lives.
"""
from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from hpct_slurm import config as CFG
from hpct_slurm import protocol as P
from hpct_slurm.controller.pacing import relayed
from hpct_slurm.errors import HpctError
from hpct_slurm.events import EventLog
from hpct_slurm.recovery.client import ControllerAddress, CoordinationClient
from hpct_slurm.relay.coalesce import WINDOW_S, Coalescer
from hpct_slurm.relay.node import NodeRelay, publish, published, relay_file
from test_controller_fast import JOB, FakeCluster, FakeStep, run

TICK_S = 1.0
_PORTS = itertools.count(42001)


# ---- what a relay forwards, and when (pure) -------------------------------------------------
def _registered(ranks: int) -> Coalescer:
    co = Coalescer(TICK_S)
    for lr in range(ranks):
        co.add(lr, P.Register(str(JOB), "n1", lr, "active", 1, "10.0.0.1", 1), 0.0)
    co.take(0.0)
    return co


def test_a_nodes_ready_reports_leave_together_once_every_rank_has_answered():
    co = _registered(3)
    assert co.wait_s(0.1) is None  # nothing buffered
    for lr in range(3):
        co.add(lr, P.Holdings(lr, 0, "jit", False, [4], [], {}), 0.10)
        assert not co.due(0.10)  # a Holdings always has its ready heartbeat right behind it
        co.add(lr, P.Heartbeat(lr, 0, 4, "ready"), 0.10)
        assert co.due(0.10) == (lr == 2)  # the last rank's answer completes the node
    out = co.take(0.11)
    assert [(lr, m.TYPE) for lr, m in out] == [(0, "holdings"), (0, "heartbeat"),
                                               (1, "holdings"), (1, "heartbeat"),
                                               (2, "holdings"), (2, "heartbeat")]
    assert co.wait_s(0.2) is None


def test_a_lone_urgent_message_waits_at_most_the_window():
    co = _registered(4)
    co.add(2, P.Heartbeat(2, 0, 4, "ready"), 5.0)  # one rank's own fault report
    assert co.wait_s(5.0) == pytest.approx(WINDOW_S)
    assert not co.due(5.0 + WINDOW_S / 2) and co.due(5.0 + WINDOW_S)
    # the same state again is routine: the controller heard it already
    co.take(5.1)
    co.add(2, P.Heartbeat(2, 0, 4, "ready"), 5.2)
    assert co.wait_s(5.2) == pytest.approx(0.1 + TICK_S - 0.2)


def test_routine_messages_keep_only_the_newest_and_go_once_per_tick():
    co = _registered(2)
    for i, state in enumerate(["running", "collective", "running"]):
        co.add(0, P.Heartbeat(0, 0, 10 + i, state), 0.1 * (i + 1))
        co.add(1, P.StepDone(1, 0, 10 + i) if i else P.StepDone(1, 0, 9), 0.1 * (i + 1))
    # rank 1's first StepDone of generation 0 was urgent: it ends a recovery round
    assert co.due(0.1 + WINDOW_S)
    first = co.take(0.2)
    assert [(lr, m.TYPE, m.step) for lr, m in first] == [
        (1, "step_done", 9), (0, "heartbeat", 12), (1, "step_done", 12)]
    co.add(0, P.Heartbeat(0, 0, 13, "running"), 0.3)
    co.add(1, P.StepDone(1, 0, 12), 0.4)
    co.add(1, P.StepDone(1, 0, 13), 0.5)
    assert not co.due(1.1) and co.due(0.2 + TICK_S)
    assert [(lr, m.step) for lr, m in co.take(1.2)] == [(0, 13), (1, 13)]
    # a new generation's first StepDone is urgent again
    co.add(1, P.StepDone(1, 1, 14), 1.3)
    assert co.wait_s(1.3) == pytest.approx(WINDOW_S)


def test_a_rank_that_left_no_longer_holds_its_node_back():
    co = _registered(3)
    co.add(0, P.Heartbeat(0, 0, 4, "ready"), 1.0)
    co.add(1, P.Left("connection lost"), 1.0)
    assert not co.due(1.0)  # rank 2 has not answered yet
    co.add(2, P.Heartbeat(2, 0, 4, "ready"), 1.01)
    assert co.due(1.01)
    assert [m.TYPE for _, m in co.take(1.01)] == ["heartbeat", "left", "heartbeat"]
    assert co.live == {0, 2}


def test_the_controller_relays_only_nodes_of_several_ranks():
    assert not relayed(1) and relayed(2) and relayed(8)


def test_the_relay_address_is_published_in_the_private_run_dir(tmp_path):
    path = relay_file(tmp_path / "run", "31", 2, 5, "n07")
    assert path == tmp_path / "run" / "relay" / "31.2.5.n07"
    with pytest.raises(HpctError, match="no node relay published"):
        published(path, timeout=0.0)
    publish(path, ("127.0.0.1", 4100))
    assert published(path, timeout=0.0) == ControllerAddress("127.0.0.1", 4100)
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    with pytest.raises(HpctError, match="cannot name a relay file"):
        relay_file(tmp_path, "31", 0, None, "../n07")


# ---- the real relay and client against the real controller ----------------------------------
class ClientRank:
    """One rank as recovery/job.py drives its controller connection: the real
    CoordinationClient, connected to its node's relay. A thread takes the assignments;
    on a STOP it reports Holdings, then `ready`, like Job._recover."""

    def __init__(self, step: "RelayStep", local_rank: int):
        self.step_proc, self.node, self.local_rank = step, step.node, local_rank
        self.assigns: list[P.Assign] = []
        self.goodbyes: list[P.Goodbye] = []
        self.own: list[int] = []
        self.crashed = False
        self.on_stop = step.cluster.on_stop.get((step.node, local_rank), "ready")
        self.client = CoordinationClient(ControllerAddress(*step.relay.address), step.secret,
                                         str(JOB), EventLog(), connect_timeout=5)
        self.client.register(step.node, local_rank, step.role, step.cluster.host_addr(step.node),
                             next(_PORTS))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        c = self.client
        while True:
            msg = c.next_assignment()
            if isinstance(msg, P.Goodbye):
                self.goodbyes.append(msg)
                c.close(msg.reason)
                if not self.crashed:
                    self.step_proc.left()
                return
            c.rank, c.generation, c.step = msg.rank, msg.generation, msg.restore_step
            self.own = [msg.restore_step] if msg.restore_step >= 0 else []
            if c.stop_generation < msg.generation:
                c.stop_event.clear()
            c.state = "running"
            self.assigns.append(msg)  # last: a test that sees it trains this generation
            while not c.stop_event.wait(0.02):
                if not c.assignments.empty() or c.closed.is_set():
                    break
            else:
                if self.on_stop == "kill relay":
                    self.step_proc.cluster.loop.call_soon_threadsafe(self.step_proc.exit, 1)
                    continue
                c.report_holdings(P.Holdings(c.rank, c.generation, "jit", False, self.own,
                                             [], {}))
                c.state = "ready"
                c.heartbeat_now()

    def fail_in_place(self) -> None:
        """Its step raised (a collective error): ready with its holdings, nobody stopped it."""
        c = self.client
        c.report_holdings(P.Holdings(c.rank, c.generation, "jit", False, self.own, [], {},
                                     error="RuntimeError: gloo"))
        c.state = "ready"
        c.heartbeat_now()

    def train(self, upto: int) -> None:
        for s in range(self.client.step + 1, upto + 1):
            self.own = [x for x in (s - 1, s) if x >= 0]
            self.client.step_done(s)

    def finish(self) -> None:
        self.client.state = "done"
        self.client.heartbeat_now()

    def crash(self) -> None:
        """The process is gone (its connection to the relay ends), and with the first local
        rank's process the relay it runs."""
        self.crashed = True
        self.client.closed.set()
        try:
            self.client._sock.shutdown(2)
        except OSError:
            pass
        if self.local_rank == 0:
            self.step_proc.kill_relay()


class RelayStep(FakeStep):
    """A node's step whose ranks talk through the real NodeRelay (started by the first)."""

    def __init__(self, cluster: "RelayCluster", node, role, argv, env):
        self.env = env
        super().__init__(cluster, node, role, argv, env)
        self.tpn = len(self.ranks)
        self.secret = P.load_secret(env["HPCT_SECRET_FILE"])
        self.ranks: list[ClientRank] = []  # type: ignore[assignment]
        self.gone = 0

    def start(self) -> None:
        """Blocking (connections and hellos both ways): run off the controller's loop."""
        host, _, port = self.env["HPCT_CONTROLLER"].rpartition(":")
        self.events = self.cluster.options.run_dir / "events" / f"{self.node}-{self.number}.jsonl"
        self.relay = NodeRelay(ControllerAddress(host, int(port)), self.secret, str(JOB),
                               self.node, self.role, 0, EventLog(self.events), tick_s=0.2)
        self.ranks = [ClientRank(self, lr) for lr in range(self.tpn)]

    def left(self) -> None:
        """A rank's thread ended after a Goodbye: the step ends with its last rank."""
        self.gone += 1
        if self.gone == self.tpn:
            self.relay.close()
            self.cluster.loop.call_soon_threadsafe(self.exit, 0)

    def kill_relay(self) -> None:
        if self.relay.closed.is_set():
            return
        self.relay.closed.set()
        self.relay._listener.close()
        try:
            self.relay._up.shutdown(2)
        except OSError:
            pass

    def exit(self, rc: int, stderr: str = "") -> None:
        if not self.relay.closed.is_set():  # not after its ranks' Goodbyes: a crash, a cancel
            for r in self.ranks:
                r.crash()
        super().exit(rc, stderr)


class RelayCluster(FakeCluster):
    def __init__(self, tmp_path, nodes, spares, tasks_per_node=3, **options):
        super().__init__(tmp_path, nodes, spares, tasks_per_node=tasks_per_node, **options)

    async def spawn(self, node, role, argv, env, log) -> RelayStep:
        assert env[CFG.RELAY] == "1"  # the controller's choice for nodes of several ranks
        step = RelayStep(self, node, role, argv, env)
        self.steps.append(step)
        await asyncio.to_thread(step.start)
        return step

    def node_ranks(self, node: str) -> list[ClientRank]:
        return [s for s in self.steps if s.node == node][-1].ranks

    async def assigned_all(self, node: str, generation: int) -> list[P.Assign]:
        def find():
            if not any(s.node == node for s in self.steps):
                return None
            got = [next((a for a in r.assigns if a.generation == generation), None)
                   for r in self.node_ranks(node)]
            return got if got and all(got) else None
        return await self.until(find, f"generation {generation} assigned to {node}'s ranks")

    async def started(self) -> None:
        for n in self.ctl.world.members:
            await self.assigned_all(n, 0)
        tpn = self.options.tasks_per_node
        for n in list(self.ctl.world.spares):
            await self.until(lambda: all((n, lr) in self.ctl.conns for lr in range(tpn)),
                             f"spare {n}'s ranks registered")

    async def train_all(self, nodes: list[str], upto: int, generation: int = 0) -> None:
        """Every rank of `nodes`, once it adopted `generation`, trains up to `upto`."""
        for n in nodes:
            await self.assigned_all(n, generation)
            for r in self.node_ranks(n):
                await asyncio.to_thread(r.train, upto)

    async def finish_all(self) -> int:
        for n in self.ctl.world.members:
            for r in self.node_ranks(n):
                r.finish()
        return await asyncio.wait_for(asyncio.shield(self.job), 5)


def test_a_round_goes_through_the_node_relays(tmp_path, monkeypatch):
    from hpct_slurm.controller import controller as CTL

    flushed: list[tuple[str, list[str]]] = []  # (node, message types), one per Batch written
    flush = CTL.Link.flush

    def recording_flush(link):
        flushed.append((link.node, [m.TYPE for _, m in link.outbox]))
        flush(link)
    monkeypatch.setattr(CTL.Link, "flush", recording_flush)

    async def scenario():
        async with RelayCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            flushed.clear()
            # one connection per node: every rank registered through its node's relay
            assert sorted(e["node"] for e in c.events("relay.register")) == \
                ["a1", "localhost", "s1"]
            assert len(c.events("rank.register")) == 9
            assert all(conn.link is not None and conn.link.node == node
                       for (node, _), conn in c.ctl.conns.items())
            assert [a.rank for a in await c.assigned_all("a1", 0)] == [3, 4, 5]
            await c.train_all(["localhost", "a1"], 4)
            await c.crash("a1")  # the node, its relay with it

            got = await c.assigned_all("s1", 1)
            assert [(a.rank, a.world_size, a.restore_step) for a in got] == \
                [(3, 6, 4), (4, 6, 4), (5, 6, 4)]
            assert got[0].members == ["localhost", "s1"]
            lh = await c.assigned_all("localhost", 1)
            assert [(a.rank, a.restore_step) for a in lh] == [(0, 4), (1, 4), (2, 4)]
            # each survivor got its own STOP through the relay, and answered through it
            for r in c.node_ranks("localhost"):
                assert r.client.stop_generation == 0 and r.client.stop_reason.startswith("a1")
            [ev] = c.events("recovery.assign")
            assert ev["taken"] == {"a1": "s1"} and ev["restore_step"] == 4
            [fault] = c.events("fault.detected")
            assert fault["node"] == "a1"  # its relay's connection, or its step's exit
            # downwards the round is one frame per node and message kind: the survivor's
            # relay got its 3 STOPs together, each member's relay its 3 Assigns together
            assert sorted(flushed) == [("localhost", ["assign"] * 3),
                                       ("localhost", ["stop"] * 3), ("s1", ["assign"] * 3)]
            assert c.events("protocol.rejected") == []

            await c.train_all(["localhost", "s1"], 5, generation=1)
            [done] = await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert (done["generation"], done["lost"]) == (1, ["a1"])
            assert await c.finish_all() == 0
            # the Goodbye reached every rank of every relay, the relay's own rank last
            for n in ("localhost", "s1"):
                assert [r.goodbyes[-1].reason for r in c.node_ranks(n)] == ["done"] * 3
    run(scenario)


def test_a_relay_lost_in_the_middle_of_a_round_is_folded_into_it(tmp_path):
    async def scenario():
        async with RelayCluster(tmp_path, ["localhost", "a1", "a2", "s1", "s2"],
                                spares=2, tasks_per_node=2) as c:
            c.on_stop[("a2", 1)] = "kill relay"  # a2's node dies as the STOP reaches it
            await c.started()
            await c.train_all(["localhost", "a1", "a2"], 3)
            await c.crash("a1")

            s1, s2 = await c.assigned_all("s1", 1), await c.assigned_all("s2", 1)
            assert [(a.rank, a.restore_step) for a in s1 + s2] == \
                [(2, 3), (3, 3), (4, 3), (5, 3)]
            [second] = c.events("fault.second")
            assert second["nodes"] == ["a2"]
            [ev] = c.events("recovery.assign")  # one round, one new generation
            assert ev["generation"] == 1 and ev["taken"] == {"a1": "s1", "a2": "s2"}
            await c.train_all(["localhost", "s1", "s2"], 4, generation=1)
            await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert await c.finish_all() == 0
    run(scenario)


def test_a_rank_lost_while_its_relay_lives_loses_its_node(tmp_path):
    async def scenario():
        async with RelayCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train_all(["localhost", "a1"], 2)
            c.node_ranks("a1")[2].crash()  # one process of a1; the relay (local rank 0) lives

            got = await c.assigned_all("s1", 1)
            assert [(a.rank, a.restore_step) for a in got] == [(3, 2), (4, 2), (5, 2)]
            [fault] = c.events("fault.detected")
            assert (fault["node"], fault["reason"]) == ("a1", "connection lost")
            # the node still answers: its step is cancelled, it comes back as a spare
            [fenced] = c.events("fault.fenced")
            assert (fenced["node"], fenced["how"]) == ("a1", "step cancelled")
            assert not any(argv[:3] == ["scontrol", "update", "NodeName=a1"]
                           for argv in c.runner.argvs)
            await c.train_all(["localhost", "s1"], 3, generation=1)
            await c.until(lambda: c.events("recovery.done"), "recovery.done")
            await c.until(lambda: all((("a1", lr) in c.ctl.conns
                                       and not c.ctl.conns[("a1", lr)].gone)
                                      for lr in range(3)), "a1 back as a spare, relayed")
            assert c.ctl.world.spares == ["a1"]
            assert await c.finish_all() == 0
    run(scenario)


def test_ranks_that_report_their_own_fault_through_the_relay_restart_in_place(tmp_path):
    """A fault report that nobody asked for (the rank's step raised) is urgent for the relay:
    it goes up within the coalescing window, and the node restarts in place."""
    from hpct_slurm.controller import controller as CTL

    async def scenario():
        async with RelayCluster(tmp_path, ["localhost", "a1", "s1"], spares=1,
                                tasks_per_node=2) as c:
            await c.started()
            await c.train_all(["localhost", "a1"], 3)
            for r in c.node_ranks("a1"):
                await asyncio.to_thread(r.fail_in_place)
            a1 = await c.assigned_all("a1", 1)
            assert [(a.rank, a.restore_step) for a in a1] == [(2, 3), (3, 3)]
            [fault] = c.events("fault.detected")
            assert (fault["node"], fault["reason"]) == ("a1", CTL.IN_PROCESS)
            [inp] = c.events("fault.in_process")
            assert inp["nodes"] == ["a1"]
            assert c.events("fault.fenced") == [] and c.node_ranks("s1")[0].assigns == []
            await c.train_all(["localhost", "a1"], 4, generation=1)
            await c.until(lambda: c.events("recovery.done"), "recovery.done")
            assert await c.finish_all() == 0
    run(scenario)


def test_an_item_of_a_rank_the_relay_never_registered_is_refused_alone(tmp_path):
    async def scenario():
        async with RelayCluster(tmp_path, ["localhost", "a1"], spares=0,
                                tasks_per_node=2) as c:
            await c.started()
            link = c.ctl.conns[("a1", 0)].link
            # an authentic frame on a1's relay link that speaks for a rank it never registered
            # and for one it did (the link's own Channel, as the relay would send them)
            c.ctl._on_batch(link, P.Batch.of([(7, P.Heartbeat(9, 0, 1, "running")),
                                              (1, P.Heartbeat(3, 0, 1, "running"))]))
            [rejected] = c.events("protocol.rejected")
            assert rejected["node"] == "a1" and rejected["local_rank"] == 7
            assert "not registered on its relay" in rejected["error"]
            assert c.ctl.conns[("a1", 1)].step == 1  # the rest of the frame counted
            with pytest.raises(P.ProtocolError, match="a node relay sends batches"):
                c.ctl._on_batch(link, P.Heartbeat(3, 0, 1, "running"))
            await c.train_all(["localhost", "a1"], 1)
            assert await c.finish_all() == 0
    run(scenario)


def test_a_relay_lets_in_only_its_own_nodes_authentic_ranks(tmp_path):
    """Every hop is authenticated: a connection to a relay without the job's secret, or an
    authentic one speaking for another node, is refused there and never reaches the
    controller; the node's real ranks go on."""
    import json
    import socket

    async def scenario():
        async with RelayCluster(tmp_path, ["localhost", "a1"], spares=0,
                                tasks_per_node=2) as c:
            await c.started()
            step = [s for s in c.steps if s.node == "a1"][-1]

            def intrude(secret: bytes, node: str) -> None:
                with socket.create_connection(step.relay.address, timeout=5) as sock:
                    chan = P.client_hello(sock, secret, str(JOB), 5)
                    chan.send(sock, P.Register(str(JOB), node, 5, "active", 1, "10.0.0.9", 1))
                    with pytest.raises(P.ProtocolError):
                        chan.recv(sock, timeout=5)  # the relay hangs up

            await asyncio.to_thread(intrude, b"x" * 32, "a1")
            await asyncio.to_thread(intrude, step.secret, "localhost")
            errors = [json.loads(line)["error"] for line in step.events.read_text().splitlines()
                      if json.loads(line)["event"] == "relay.rejected"]
            assert len(errors) == 2 and "bad MAC" in errors[0]
            assert "must be a Register of that node" in errors[1]
            assert c.events("protocol.rejected") == [] and c.events("fault.detected") == []
            assert len(c.events("rank.register")) == 4
            await c.train_all(["localhost", "a1"], 1)
            assert await c.finish_all() == 0
    run(scenario)


def test_a_local_rank_that_stops_reading_is_cut_and_the_others_still_hear(tmp_path,
                                                                          monkeypatch):
    """The relay's one downward thread sends to every local rank: a rank that stops reading
    (hung, or SIGSTOPped) once filled its buffers and held up every message to the node's
    other ranks for good. Now a send that waits past DELIVER_TIMEOUT_S cuts that rank: the
    controller hears it as the rank's loss (Left) and the others still get their messages."""
    import json
    import os
    import socket
    import time

    from hpct_slurm.relay import node as relay_node

    monkeypatch.setattr(relay_node, "DELIVER_TIMEOUT_S", 0.3)
    secret, job = b"s" * 32, str(JOB)
    listener = socket.create_server(("127.0.0.1", 0))
    up: dict = {}

    def controller() -> None:
        sock, _ = listener.accept()
        chan = P.server_hello(sock, secret, job, 5)
        assert isinstance(chan.recv(sock, timeout=5).msg, P.RelayHello)
        up.update(sock=sock, chan=chan)

    t = threading.Thread(target=controller)
    t.start()
    log = tmp_path / "relay.jsonl"
    relay = NodeRelay(ControllerAddress("127.0.0.1", listener.getsockname()[1]), secret, job,
                      "a1", "active", 0, EventLog(log), tick_s=0.05, window_s=0.01)
    t.join(5)
    ctl, ctl_chan = up["sock"], up["chan"]

    def local(lr: int) -> tuple[socket.socket, P.Channel]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(relay.address)
        chan = P.client_hello(sock, secret, job, 5)
        chan.send(sock, P.Register(job, "a1", lr, "active", os.getpid(), "127.0.0.1", 1))
        return sock, chan

    live, live_chan = local(0)
    stuck, _ = local(1)  # registers, then never reads again
    deadline = time.monotonic() + 5
    while len(relay._local) < 2:
        assert time.monotonic() < deadline, "the local ranks did not register"
        time.sleep(0.01)
    relay._local[1].sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    try:
        # Enough for the stuck rank to fill its buffers many times over, then one message
        # for the live rank behind them.
        for _ in range(100):
            ctl_chan.send(ctl, P.Batch.of([(1, P.Goodbye("x" * 8000))]))
        ctl_chan.send(ctl, P.Batch.of([(0, P.Goodbye("for the live rank"))]))
        assert live_chan.recv(live, timeout=10).msg == P.Goodbye("for the live rank")
        # The stuck rank's loss went up: the controller sees its Left.
        items: list = []
        deadline = time.monotonic() + 10
        while not any(lr == 1 and isinstance(m, P.Left) for lr, m in items):
            assert time.monotonic() < deadline, f"no Left for the stuck rank in {items}"
            msg = ctl_chan.recv(ctl, timeout=10).msg
            if isinstance(msg, P.Batch):
                items += msg.messages()
        cut = [json.loads(line) for line in log.read_text().splitlines()
               if json.loads(line)["event"] == "relay.rank_cut"]
        assert [(e["local_rank"], e["node"]) for e in cut] == [(1, "a1")]
    finally:
        live.close()
        stuck.close()
        relay.close(wait_s=1)
        ctl.close()
        listener.close()
