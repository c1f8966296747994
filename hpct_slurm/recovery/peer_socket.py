"""The TCP connections that carry state between ranks: a replacement's pull from a source's
`TransferServer` (transfer.py's whole-blob fetch, striped.py's stripes) and a rank's replica
push to its ring neighbour, all with the same buffers.

A floor below transfer.py and striped.py: both open these connections, and the transfer
server also serves striped pulls (`serve_part`), so taking the connect from transfer.py
would make each import the other.
"""
from __future__ import annotations

import socket

SOCK_BUF = 4 * 1024 * 1024  # measured: 4 MB socket buffers reach loopback's 2.4-2.9 GB/s
Address = tuple[str, int]


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)


def connect(addr: Address, timeout: float) -> socket.socket:
    sock = socket.create_connection(addr, timeout=timeout)
    tune(sock)
    return sock


def peer_of(sock: socket.socket) -> str:
    """`host:port` of the other end ("" once the connection is gone)."""
    try:
        return "%s:%s" % sock.getpeername()[:2]
    except OSError:
        return ""
