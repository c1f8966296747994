"""Cutting a rank's own connections to lost nodes (recovery/sever.py)."""
from __future__ import annotations

import socket
import threading
import time

from hpct_slurm.proc_tcp import decode_addr
from hpct_slurm.recovery.sever import sever, socket_inodes_to

TABLE = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1
   1: 0B4D0A0A:A2F4 0D4D0A0A:4E34 01 00000000:00000000 00:00000000 00000000     0        0 222 1
   2: 0B4D0A0A:A2F6 0E4D0A0A:4E34 01 00000000:00000000 00:00000000 00000000     0        0 333 1
   3: 0B4D0A0A:A2F8 0D4D0A0A:4E35 06 00000000:00000000 00:00000000 00000000     0        0 0 1
"""


def test_decode_proc_net_tcp_addresses():
    assert decode_addr("0100007F:1F90") == "127.0.0.1"
    assert decode_addr("0D4D0A0A:4E34") == "10.10.77.13"
    # ::ffff:10.77.0.13 as /proc/net/tcp6 writes it: four host-order 32-bit words
    assert decode_addr("0000000000000000FFFF00000D004D0A:1F90") == "10.77.0.13"


def test_only_connections_to_the_lost_addresses_are_selected():
    # the listener (0A) and a socket already gone (inode 0) never count
    assert socket_inodes_to(TABLE, {"10.10.77.13"}) == {222}
    assert socket_inodes_to(TABLE, {"10.10.77.13", "10.10.77.14"}) == {222, 333}
    assert socket_inodes_to(TABLE, {"127.0.0.1"}) == set()
    assert socket_inodes_to("header\ngarbage line\n", {"10.10.77.13"}) == set()


def _pair(host: str) -> tuple[socket.socket, socket.socket, socket.socket]:
    srv = socket.create_server((host, 0))
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    return srv, cli, conn


def test_a_read_blocked_on_a_silent_peer_ends_at_once():
    """A peer that sends nothing (a crashed node, a cut link) holds a blocked recv forever;
    after sever() it returns immediately. Connections to other addresses are untouched."""
    srv, cli, conn = _pair("127.0.0.2")   # the "lost node"
    srv2, other, conn2 = _pair("127.0.0.3")  # a healthy peer
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(cli.recv(10)), daemon=True)
    t.start()
    time.sleep(0.1)
    assert t.is_alive()  # blocked: the peer is silent
    assert sever(["127.0.0.2"], keep={"127.0.0.1"}) == 1
    t.join(2)
    assert not t.is_alive() and got == [b""]
    conn2.sendall(b"ok")
    assert other.recv(2) == b"ok"
    for s in (srv, cli, conn, srv2, other, conn2):
        s.close()


def test_own_address_is_never_cut():
    srv, cli, conn = _pair("127.0.0.2")
    assert sever(["127.0.0.2"], keep={"127.0.0.2"}) == 0
    conn.sendall(b"x")
    assert cli.recv(1) == b"x"
    for s in (srv, cli, conn):
        s.close()


def test_the_controller_connection_is_spared_when_the_batch_hosts_rank_is_lost():
    """The batch host's rank dies but its node (and the controller on it) lives: connections
    to that address are cut, except the control connection itself."""
    srv, ctl, _ctl_peer = _pair("127.0.0.2")
    data = socket.create_connection(srv.getsockname())
    data_peer, _ = srv.accept()
    assert sever(["127.0.0.2"], keep_fds={ctl.fileno()}) == 1
    assert data.recv(1) == b""  # cut
    _ctl_peer.sendall(b"c")
    assert ctl.recv(1) == b"c"  # spared
    for s in (srv, ctl, _ctl_peer, data, data_peer):
        s.close()


def test_to_the_own_node_only_what_this_process_opened_is_selected():
    """Issue 46: a TP pair inside a node, one of its ranks gone to recovery, the other blocked
    on it; sever's `outbound` addresses (this node's own) select the connections this process
    opened (its local port is none of its listeners'), never those others opened to it."""
    table = (TABLE.splitlines()[0] + "\n"
             # our listener on 7000 (inode 500), a connection accepted on it (501), one we
             # opened from an ephemeral port to a peer's listener on 8000 (502), and a listener
             # of another process (inode 600) whose port we happen to connect from (503)
             "   0: 0B4D0A0A:1B58 00000000:0000 0A 0:0 00:0 0 0 0 500 1\n"
             "   1: 0B4D0A0A:1B58 0B4D0A0A:C350 01 0:0 00:0 0 0 0 501 1\n"
             "   2: 0B4D0A0A:C351 0B4D0A0A:1F40 01 0:0 00:0 0 0 0 502 1\n"
             "   3: 0B4D0A0A:2328 00000000:0000 0A 0:0 00:0 0 0 0 600 1\n"
             "   4: 0B4D0A0A:2328 0B4D0A0A:1F41 01 0:0 00:0 0 0 0 503 1\n")
    own = {500, 501, 502, 503}
    assert socket_inodes_to(table, set(), {"10.10.77.11"}, own) == {502, 503}
    assert socket_inodes_to(table, set(), set(), own) == set()
    # without our listeners known, every connection to the address counts as ours
    assert socket_inodes_to(table, set(), {"10.10.77.11"}) == {501, 502, 503}


def test_a_pair_between_two_processes_of_one_node_is_cut_from_the_end_that_opened_it():
    srv, cli, conn = _pair("127.0.0.2")  # cli: opened by this process; conn: accepted
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(conn.recv(10)), daemon=True)
    t.start()
    time.sleep(0.1)
    assert t.is_alive()
    # the accepted end (local port = our listener's) is spared, the opened end is cut: the
    # read blocked on the accepted end ends with the peer's shutdown
    assert sever([], outbound=["127.0.0.2"]) == 1
    t.join(2)
    assert not t.is_alive() and got == [b""]
    for s in (srv, cli, conn):
        s.close()
