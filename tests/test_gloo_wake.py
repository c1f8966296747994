"""gloo_wake's reading of what a rank published for gloo's full mesh (pure), and the wake on a
real listener. The formation it ends is tested in test_rendezvous_pg.py (stop-wakes-pairs)."""
from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from hpct_slurm import proc_tcp
from hpct_slurm.rendezvous import gloo_wake

# Rank 0 of a real 3-rank gloo formation over loopback (torch 2.13.0's gloo, FileStore,
# GLOO_SOCKET_IFNAME=lo): hostname "vm", listener 127.0.0.1:37933, pair numbers 0, 1, 2.
# The bytes after the address in sockaddr_storage are uninitialised padding in gloo.
REAL = bytes.fromhex(
    "0200000000000000766d88000000000000000200942d7f000001000000000000000002ed141305ecf7bf"
    "020b0e140312030a1e020e11041e021412130e0c1e02001e000000000000000000000000000000000000"
    "0000000000000000000000000000212e2a2c202bbf2d211e0d0eed08120eecf7f7f4f8ecf0bf22203320"
    "2b202dbf00000000000000000000000000000000ffffffffffffffff0000000000000000010000000000"
    "00000200000000000000")


def _published(host: str, port: int, seqs: list[int], hostname: bytes = b"node1",
               family: int = socket.AF_INET, addr_size: int = 136) -> bytes:
    sa = bytearray(128)
    struct.pack_into("=H", sa, 0, family)
    struct.pack_into("!H", sa, 2, port)
    if family == socket.AF_INET6:
        sa[8:24] = socket.inet_pton(socket.AF_INET6, host)
    else:
        sa[4:8] = socket.inet_aton(host)
    address = bytes(sa) + struct.pack("=q", -1)
    return (struct.pack("=Q", len(hostname)) + hostname + struct.pack("=Q", addr_size)
            + address[:addr_size].ljust(addr_size, b"\0")
            + b"".join(struct.pack("=q", s) for s in seqs))


def test_reads_what_torchs_gloo_published():
    p = gloo_wake.parse(REAL, 3)
    assert (p.hostname, p.host, p.port, p.pair_seqs) == ("vm", "127.0.0.1", 37933, (0, 1, 2))
    assert [p.seq_for(peer) for peer in (1, 2)] == [1, 2]


def test_ranks_as_sequence_numbers_and_ipv6():
    p = gloo_wake.parse(_published("fe80::1", 9000, [], family=socket.AF_INET6), 4)
    assert (p.host, p.port, p.pair_seqs, p.seq_for(3)) == ("fe80::1", 9000, (), 3)


@pytest.mark.parametrize("raw, what", [
    (b"", "ends before its hostname size"),
    (struct.pack("=Q", 10**9) + b"x", "hostname size"),
    (_published("10.0.0.1", 5, [0, 1], addr_size=24), "not the 136"),
    (_published("10.0.0.1", 5, [0, 1], family=1), "address family 1"),
    (_published("10.0.0.1", 0, [0, 1]), "listener port 0"),
    (_published("10.0.0.1", 5, [0, 1]) + b"\1\2\3", "trailing bytes"),
    (_published("10.0.0.1", 5, [0, 1, 2]), "3 pair sequence numbers for a world of 2"),
])
def test_anything_else_is_refused_with_the_reason(raw, what):
    with pytest.raises(ValueError, match=what):
        gloo_wake.parse(raw, 2)


def test_wake_writes_each_peers_number_to_the_own_listener_and_hangs_up():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    got: list[tuple[int, bytes]] = []

    def accept() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                data = b""
                while chunk := conn.recv(64):
                    data += chunk
                got.append(struct.unpack("=Q", data[:8])[0] if len(data) >= 8 else -1)
                got[-1] = (got[-1], data[8:])

    t = threading.Thread(target=accept)
    t.start()
    own = gloo_wake.parse(_published("127.0.0.1", port, [7, 8, 9]), 3)
    assert gloo_wake.wake(own, rank=1, peers=range(3)) == 2  # never itself
    t.join(10)
    listener.close()
    # the numbers rank 1 published for peers 0 and 2, nothing after them, then the hang-up
    assert sorted(got) == [(7, b""), (9, b"")]


def test_a_closed_listener_wakes_nobody():
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    own = gloo_wake.parse(_published("127.0.0.1", port, [0, 1]), 2)
    assert gloo_wake.wake(own, rank=0, peers=[1], timeout_s=0.5) == 0


def test_the_whole_wake_is_bounded_when_the_listener_takes_nobody():
    """Issue 45, item 5: one connect at a time with a 1 s timeout each, on the thread that
    reads the controller's connection: 5.0 s for 6 peers whose listener's backlog was full.
    Now every connect is on its way at once and the wake as a whole ends at its deadline
    (12 peers at 0.5 s: 6 s one after another; the bound checked is half of that)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepts: its queue holds one connection, then SYNs are dropped
    port = listener.getsockname()[1]
    queued = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        queued.append(s)
    own = gloo_wake.parse(_published("127.0.0.1", port, list(range(13))), 13)
    try:
        t0 = time.monotonic()
        woken = gloo_wake.wake(own, rank=0, peers=range(13), timeout_s=0.5)
        took = time.monotonic() - t0
    finally:
        for s in queued:
            s.close()
        listener.close()
    assert woken == 0, "a connection got through a full backlog"
    assert took < 3.0, f"the wake took {took:.1f} s"


# ---- the side that connects: which of this process's connections the STOP resets ----------
def _row(local: str, remote: str, state: str, inode: str) -> str:
    return (f"   0: {local} {remote} {state} 00000000:00000000 00:00000000 00000000     0        "
            f"0 {inode} 1 0000000000000000 100 0 0 10 0")


HEAD = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode")


def _hex4(host: str, port: int) -> str:
    word = struct.unpack("=I", socket.inet_aton(host))[0]
    return f"{word:08X}:{port:04X}"


def _hex6(host: str, port: int) -> str:
    raw = socket.inet_pton(socket.AF_INET6, host)
    words = struct.unpack("=4I", raw)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def test_only_own_connects_in_flight_to_a_members_listener_are_picked():
    peer = gloo_wake.endpoint("10.0.0.2", 40001)
    v6 = gloo_wake.endpoint("fd00::2", 40002)
    tcp = "\n".join([HEAD,
                     _row(_hex4("10.0.0.1", 5555), _hex4("10.0.0.2", 40001), "02", "101"),
                     # another process's connect to the same listener: not ours to reset
                     _row(_hex4("10.0.0.1", 5556), _hex4("10.0.0.2", 40001), "02", "999"),
                     # ours, established: a pair already connected
                     _row(_hex4("10.0.0.1", 5557), _hex4("10.0.0.2", 40001), "01", "102"),
                     # ours, in flight, to something else (the store, the controller)
                     _row(_hex4("10.0.0.1", 5558), _hex4("10.0.0.9", 20000), "02", "103"),
                     "   garbage"])
    tcp6 = "\n".join([HEAD, _row(_hex6("fd00::1", 5559), _hex6("fd00::2", 40002), "02", "104"),
                      # IPv4-mapped: the same listener as its IPv4 address
                      _row(_hex6("::ffff:10.0.0.2", 5560), _hex6("::ffff:10.0.0.2", 40001),
                           "02", "105")])
    inodes = {101: 11, 102: 12, 103: 13, 104: 14, 105: 15}
    assert gloo_wake.connecting([tcp, tcp6], inodes, {peer, v6}) == [(11, 101), (14, 104),
                                                                      (15, 105)]
    assert gloo_wake.connecting([tcp, tcp6], inodes, set()) == []


def test_the_listeners_are_the_other_ranks_readable_addresses():
    values = [_published("10.0.0.1", 40000, [0, 1, 2]), _published("10.0.0.2", 40001, [0, 1, 2]),
              b"not gloo's"]
    assert gloo_wake.listeners(values, 3, rank=0) == {gloo_wake.endpoint("10.0.0.2", 40001)}
    assert gloo_wake.listeners((), 3, rank=0) == set()


def test_a_connect_in_flight_is_reset_and_nothing_else_is():
    """A real socket of this process in SYN_SENT (to an address that never answers: a
    listener's backlog full of unaccepted connections drops SYNs) is reset; the established
    ones and the listener are untouched."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    held = []
    try:
        # fill the accept queue (backlog 0 holds one): the next SYN is dropped, not answered
        for _ in range(8):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            held.append(s)
        time.sleep(0.2)
        target = {gloo_wake.endpoint("127.0.0.1", port)}
        fds = gloo_wake.connecting(proc_tcp.tables(), proc_tcp.own_socket_fds(), target)
        assert fds, "no connection stuck in SYN_SENT: the backlog did not fill"
        assert gloo_wake.reset_connects(target, lambda: True, timeout_s=2.0) == len(fds)
        for s in held:
            if s.fileno() in dict(fds):  # the connect ended with the reset, on our own fd
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
        assert gloo_wake.connecting(proc_tcp.tables(), proc_tcp.own_socket_fds(),
                                    target) == []
        # nothing reset while the formation is over, nor a descriptor that names another
        # socket than the one listed
        assert gloo_wake.reset_connects(target, lambda: False) == 0
        assert not proc_tcp.shut_down(srv.fileno(), fds[0][1])
    finally:
        for s in held:
            s.close()
        srv.close()
