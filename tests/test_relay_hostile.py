"""Issue 30, section 3: what a hostile neighbour (or a legal frame) could still do to a node
relay (relay/node.py), over real loopback TCP against a stand-in controller that reads what
the relay sends up exactly as the controller does (every Batch through `messages()`).

* strangers: another user on the node connects to the relay's port. Each must authenticate
  within the relay's auth timeout, at most `max_strangers` are held (the oldest dropped for a
  newcomer), and a process out of descriptors pauses accepting instead of ending it;
* what the relay cannot forward: a rank's frame that fits alone but not inside a Batch, and a
  relay's own message (Batch, RelayHello, Left) from a rank, cut that rank only;
* no silent dead thread: an unexpected error in a relay thread is recorded and the relay goes
  down, so the controller and the ranks see their connections end.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hpct_slurm import protocol as P
from hpct_slurm.events import EventLog
from hpct_slurm.recovery.client import ControllerAddress
from hpct_slurm.relay import node as relay_node
from hpct_slurm.relay.node import NodeRelay
from test_hostile_network import _cpu_seconds

SECRET, JOB, NODE = b"s" * 32, "41", "a1"
ROOT = Path(__file__).parents[1]


def _events(path: Path, name: str) -> list[dict]:
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == name]


def _within(pred, what: str, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.02)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer ends the connection within `seconds` (what it sent before is read)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(1 << 16):
                return True
        except ConnectionError:
            return True
        except (socket.timeout, TimeoutError):
            return False
    return False


class Controller:
    """The controller's end of a relay's link: accepts it, then reads its frames the way
    connections.py does (anything but a Batch, or a Batch whose items do not parse, would make
    the controller drop the node's link: here it fails the test)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = ControllerAddress("127.0.0.1", self.listener.getsockname()[1])
        self.items: list[tuple[int, object]] = []
        self.sock: socket.socket | None = None
        self.chan: P.Channel | None = None
        self._accepted = threading.Thread(target=self._accept, daemon=True)
        self._accepted.start()

    def _accept(self) -> None:
        self.listener.settimeout(60)
        sock, _ = self.listener.accept()
        chan = P.server_hello(sock, SECRET, JOB, 5)
        assert isinstance(chan.recv(sock, timeout=30).msg, P.RelayHello)
        self.sock, self.chan = sock, chan

    def linked(self, timeout: float = 60) -> None:
        self._accepted.join(timeout)
        assert self.sock is not None, "the relay never opened its link"

    def until(self, pred, what: str, timeout: float = 5.0) -> None:
        """Read the link's frames until `pred(items)`, for at most `timeout` s."""
        deadline = time.monotonic() + timeout
        for _ in range(10_000):
            if pred(self.items):
                return
            left = deadline - time.monotonic()
            assert left > 0, f"{what}: not within {timeout} s; the relay sent {self.items}"
            try:
                msg = self.chan.recv(self.sock, timeout=left).msg
            except P.ProtocolTimeout:
                continue
            assert isinstance(msg, P.Batch), f"the relay sent up a {msg.TYPE}"
            self.items += msg.messages()  # raises as the controller would drop the link
        raise AssertionError(f"{what}: too many frames")

    def close(self) -> None:
        for s in (self.sock, self.listener):
            if s is not None:
                s.close()


class Rank:
    """A local rank's connection to the relay, as CoordinationClient opens it."""

    def __init__(self, relay_address: tuple[str, int], lr: int):
        self.lr = lr
        self.sock = socket.create_connection(relay_address, timeout=5)
        self.chan = P.client_hello(self.sock, SECRET, JOB, 5)
        self.send(P.Register(JOB, NODE, lr, "active", os.getpid(), "127.0.0.1", 1))

    def send(self, msg) -> None:
        self.chan.send(self.sock, msg)


@pytest.fixture
def link(tmp_path):
    """(controller, relay, its event log); the relay's knobs through `link.make(...)`."""
    ctl = Controller()
    made: list[NodeRelay] = []
    log = tmp_path / "relay.jsonl"

    def make(**kw) -> NodeRelay:
        relay = NodeRelay(ctl.address, SECRET, JOB, NODE, "active", 0, EventLog(log),
                          tick_s=0.05, window_s=0.01, **kw)
        made.append(relay)
        ctl.linked()
        return relay

    yield ctl, make, log
    for relay in made:
        relay.close(wait_s=0.2)
    ctl.close()


def _registered(ctl: Controller, *lrs: int) -> None:
    ctl.until(lambda items: {lr for lr, m in items if isinstance(m, P.Register)} >= set(lrs),
              f"local ranks {lrs} registered")


def _heard(ctl: Controller, lr: int, step: int) -> None:
    ctl.until(lambda items: any(i == lr and isinstance(m, P.Heartbeat) and m.step == step
                                for i, m in items), f"local rank {lr}'s heartbeat of step {step}")


# ---- strangers ---------------------------------------------------------------------------------
def test_a_silent_or_trickling_stranger_is_dropped_within_the_auth_timeout(link):
    """A stranger had 30 s to authenticate, one thread and one descriptor each all along."""
    assert relay_node.AUTH_TIMEOUT_S <= 10
    ctl, make, log = link
    relay = make(auth_timeout=0.5)
    silent = socket.create_connection(relay.address)
    trickling = socket.create_connection(relay.address)
    t0 = time.monotonic()
    trickled = 0
    for _ in range(30):  # a byte of a frame length every 0.05 s: never a whole header
        try:
            trickling.send(b"\x00" if trickled < 3 else b"\x01")
        except OSError:
            break
        trickled += 1
        time.sleep(0.05)
    assert _closed_within(silent, 2.0) and _closed_within(trickling, 2.0)
    assert time.monotonic() - t0 < 2.5
    rejected = _events(log, "relay.rejected")
    assert len(rejected) == 2 and all("timed out" in e["error"] for e in rejected)
    rank = Rank(relay.address, 0)
    _registered(ctl, 0)
    for s in (silent, trickling, rank.sock):
        s.close()


def test_strangers_are_capped_and_the_oldest_dropped_for_a_newcomer(link):
    """400 idle connections took a relay from 5 to 405 threads and 13 to 813 descriptors."""
    ctl, make, log = link
    relay = make(auth_timeout=30, max_strangers=8)
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    crowd = []
    for _ in range(40):
        crowd.append(socket.create_connection(relay.address, timeout=5))
        # each has its nonce: the relay took it in (the backlog alone holds no thread)
        assert len(crowd[-1].recv(P.NONCE_BYTES, socket.MSG_WAITALL)) == P.NONCE_BYTES
    t0 = time.monotonic()
    rank = Rank(relay.address, 0)  # the node's own rank gets in at once, crowd or not
    _registered(ctl, 0)
    assert time.monotonic() - t0 < 1.0
    # The oldest 32 (and one more, for the rank) were dropped; the newest are still held.
    assert sum(_closed_within(s, 2.0) for s in crowd[:32]) == 32
    assert not _closed_within(crowd[-1], 0.2)
    # (the evicted connections' threads end a moment after their peers see the end)
    _within(lambda: threading.active_count() - threads <= 8 + 1 + 2, "the relay's threads")
    _within(lambda: len(os.listdir("/proc/self/fd")) - fds <= 40 + 1 + (8 + 1) + 2,
            "descriptors: ours and the relay's")
    evicted = _events(log, "relay.connection_evicted")
    assert len(evicted) == 33 and "cap of 8" in evicted[0]["error"]
    assert _events(log, "relay.rejected") == []  # an eviction is recorded once
    rank.send(P.Heartbeat(0, 0, 3, "running"))
    _heard(ctl, 0, 3)
    for s in crowd + [rank.sock]:
        s.close()


_FD_CHILD = textwrap.dedent("""
    import os, resource, sys
    sys.path.insert(0, {root!r})
    from hpct_slurm.events import EventLog
    from hpct_slurm.recovery.client import ControllerAddress
    from hpct_slurm.relay.node import NodeRelay
    relay = NodeRelay(ControllerAddress("127.0.0.1", int(sys.argv[1])), b"s" * 32, "41", "a1",
                      "active", 0, EventLog(sys.argv[2]), tick_s=0.05, window_s=0.01)
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (used + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(relay.address[1], flush=True)
    sys.stdin.read()
""")


def _cpu_over(pid: int, seconds: float) -> float:
    """CPU seconds process `pid` used over the next `seconds`."""
    before = _cpu_seconds(pid)
    time.sleep(seconds)
    return _cpu_seconds(pid) - before


def _line_within(pipe, seconds: float) -> str:
    ready, _, _ = select.select([pipe], [], [], seconds)
    assert ready, f"no line from the child within {seconds} s"
    return pipe.readline()


def test_out_of_descriptors_the_relay_pauses_accepting_and_then_accepts_again(tmp_path):
    """On EMFILE the accept loop returned, and the node's ranks could never reach it again."""
    ctl = Controller()
    log = tmp_path / "relay.jsonl"
    child = subprocess.Popen([sys.executable, "-c", _FD_CHILD.format(root=str(ROOT)),
                              str(ctl.address.port), str(log)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    flood: list[socket.socket] = []
    try:
        port = int(_line_within(child.stdout, 60))
        ctl.linked()
        flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(30)]
        time.sleep(0.3)
        assert _cpu_over(child.pid, 1.0) < 0.5  # backing off, not spinning
        for s in flood:
            s.close()
        time.sleep(1.2)  # the longest back-off
        t0 = time.monotonic()
        rank = Rank(("127.0.0.1", port), 0)
        _registered(ctl, 0)
        assert time.monotonic() - t0 < 1.0
        rank.sock.close()
        # The event could not be written while out of descriptors: it was once they were back
        # (the flood's rest, still in the backlog, may have run the process out again).
        failed = _events(log, "relay.accept_failed")
        assert failed and "errno 24" in failed[0]["error"]
    finally:
        for s in flood:
            s.close()
        child.stdin.close()
        child.wait(10)
        ctl.close()


# ---- what the relay cannot forward ---------------------------------------------------------------
def _just_under_the_header_limit(lr: int) -> P.Holdings:
    """A Holdings whose own frame header is a few bytes under HEADER_MAX: legal from a rank,
    over the limit once wrapped in a Batch."""
    def header(n: int) -> int:
        msg = P.Holdings(lr, 0, "jit", False, [4], [], {}, error="x" * n)
        return len(P.encode(msg, SECRET, 99, JOB, context=b"")) - 4 - P.MAC_LEN

    n = P.HEADER_MAX - 4 - header(0)
    assert P.HEADER_MAX - 8 <= header(n) <= P.HEADER_MAX - 4
    return P.Holdings(lr, 0, "jit", False, [4], [], {}, error="x" * n)


def _cut_alone(ctl: Controller, relay: NodeRelay, log: Path, cut: Rank, other: Rank,
               type_: str) -> None:
    """`cut`'s connection was refused and ended, its loss went up as Left, the node's link
    and `other` went on."""
    ctl.until(lambda items: any(lr == cut.lr and isinstance(m, P.Left) for lr, m in items),
              f"local rank {cut.lr}'s Left")
    assert _closed_within(cut.sock, 2.0)
    [refused] = _events(log, "relay.rank_refused")
    assert (refused["local_rank"], refused["type"], refused["node"]) == (cut.lr, type_, NODE)
    other.send(P.Heartbeat(other.lr, 0, 7, "running"))
    _heard(ctl, other.lr, 7)
    assert {t.name for t in threading.enumerate()} >= {"hpct-relay-tx", "hpct-relay-rx",
                                                       "hpct-relay-accept"}
    assert _events(log, "relay.failed") == [] and not relay.closed.is_set()


def test_a_legal_frame_too_big_for_a_batch_cuts_its_rank_not_the_relay(link):
    """A rank's 65,532-byte Holdings is 65,555 bytes in a Batch: HeaderTooLarge ended the
    relay's upward thread, and the node's heartbeats stopped reaching the controller."""
    ctl, make, log = link
    relay = make()
    r0, r1 = Rank(relay.address, 0), Rank(relay.address, 1)
    _registered(ctl, 0, 1)
    r1.send(_just_under_the_header_limit(1))  # its own frame is legal: it goes out
    r1.send(P.Heartbeat(1, 0, 4, "ready"))
    _cut_alone(ctl, relay, log, r1, r0, "holdings")
    assert "too big" in _events(log, "relay.rank_refused")[0]["error"]
    assert not any(isinstance(m, P.Holdings) for _, m in ctl.items)
    r0.sock.close()


@pytest.mark.parametrize("own", [
    P.Batch.of([(0, P.Heartbeat(0, 0, 9, "unhealthy"))]),  # speaking for another rank, too
    P.RelayHello(JOB, NODE, "active", 1),
    P.Left("not its word to say"),
], ids=lambda m: m.TYPE)
def test_a_relays_own_message_from_a_rank_cuts_that_rank_not_the_nodes_link(link, own):
    """A Batch sent up by a local rank was forwarded as is, and the controller dropped the
    whole node's link ("a batch cannot be batched")."""
    ctl, make, log = link
    relay = make()
    r0, r1 = Rank(relay.address, 0), Rank(relay.address, 1)
    _registered(ctl, 0, 1)
    r1.send(own)
    _cut_alone(ctl, relay, log, r1, r0, own.TYPE)
    assert [m for lr, m in ctl.items if lr == 1] == [
        P.Register(JOB, NODE, 1, "active", os.getpid(), "127.0.0.1", 1), P.Left("connection lost")]
    assert not any(isinstance(m, P.Heartbeat) and m.step == 9 for _, m in ctl.items)
    r0.sock.close()


# ---- no silent dead thread -----------------------------------------------------------------------
@pytest.mark.parametrize("thread", ["hpct-relay-tx", "hpct-relay-rx"])
def test_an_unexpected_error_in_a_relay_thread_takes_the_relay_down_loudly(link, thread):
    """Not a silent dead thread: the error is recorded, and the controller and the node's
    ranks see their connections end (the node is then replaced) instead of a relay that looks
    alive and forwards nothing."""
    ctl, make, log = link
    relay = make()
    r0 = Rank(relay.address, 0)
    _registered(ctl, 0)

    def boom(*_args):
        raise RuntimeError("a bug")
    if thread == "hpct-relay-tx":
        relay._co.take = boom
        r0.send(P.Heartbeat(0, 0, 4, "ready"))  # urgent: flushed at once
    else:
        relay._deliver = boom
        ctl.chan.send(ctl.sock, P.Batch.of([(0, P.Goodbye("done"))]))
    assert _closed_within(r0.sock, 5.0)
    assert _closed_within(ctl.sock, 5.0)
    [failed] = _events(log, "relay.failed")
    assert (failed["thread"], failed["error"]) == (thread, "RuntimeError: a bug")
    with pytest.raises(OSError):  # no new rank gets in to wait on it
        Rank(relay.address, 1).sock.recv(1)
    r0.sock.close()
