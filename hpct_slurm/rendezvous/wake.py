"""Wake a lazy gloo pair that waits for a peer which will never connect.

With lazy pairs (TORCH_GLOO_LAZY_INIT=1) a pair connects on its first use, and one side of it
only listens: it waits for the peer to connect and name the pair, with no socket of its own
yet. If that peer is dead, or has left the collective for recovery, nothing arrives; the wait
ends only at the pair's timeout, which gloo takes from the group's timeout when init made the
pair: the init timeout (600 s by default), not the collective timeout. No connection exists
for sever.py to cut, and the group has no abort that reaches it (torch 2.13's
ProcessGroupGloo.abort() left it waiting in a probe). Measured (4 loopback ranks, the
broadcast root's pair to a SIGKILLed rank new): the root waited like this in 2 of 6 runs.

What does end it: the connection it waits for. gloo's listener takes a connection, reads the
8-byte sequence number the connecting side writes, and hands the socket to the pair waiting
for that number; with lazy pairs that number is the peer's rank in the group (gloo's
tcp/context.cc `getPair`). `wake` connects to this process's own gloo listener as every
peer in turn and closes at once: a waiting pair gets a socket that is already closed and fails
its collective with "Connection closed by peer", as a pair to a dead peer does in the full
mesh. A connection nobody waits for yet is parked by the listener until a pair asks for its
number, and that pair then fails the same way: so this is only for a group that is being
given up (a STOP).
"""
from __future__ import annotations

import socket
import struct
from collections.abc import Iterable

_SIZE_T = struct.Struct("=Q")
_SEQ = struct.Struct("=q")  # gloo's sequence_number_t is ssize_t, written in host order
_AF_INET, _AF_INET6 = 2, 10  # Linux sa_family values in gloo's sockaddr bytes
WAKE_CONNECT_TIMEOUT_S = 1.0


def gloo_listener(record: bytes) -> tuple[str, int] | None:
    """The listening address in gloo's rank record, the value gloo sets under
    `<head>/<rank>` (tcp/context.cc `Rank::bytes`: size_t hostname length, hostname, size_t
    address length, the address as a sockaddr, then pair ids); None if it is not one."""
    try:
        (n,) = _SIZE_T.unpack_from(record, 0)
        off = _SIZE_T.size + n
        (alen,) = _SIZE_T.unpack_from(record, off)
        addr = record[off + _SIZE_T.size:off + _SIZE_T.size + alen]
        (family,) = struct.unpack_from("=H", addr, 0)
        (port,) = struct.unpack_from("!H", addr, 2)
        if family == _AF_INET and len(addr) >= 8:
            return socket.inet_ntop(socket.AF_INET, addr[4:8]), port
        if family == _AF_INET6 and len(addr) >= 24:
            return socket.inet_ntop(socket.AF_INET6, addr[8:24]), port
    except (struct.error, ValueError, OSError):
        return None
    return None


def wake(listener: tuple[str, int], peers: Iterable[int]) -> int:
    """Connect to `listener` (this process's own gloo listener) once as each of `peers`,
    writing its sequence number and closing. Returns how many connections were made; stops at
    the first refusal (the group, and its listener, are already gone)."""
    made = 0
    for peer in peers:
        try:
            with socket.create_connection(listener, timeout=WAKE_CONNECT_TIMEOUT_S) as s:
                s.sendall(_SEQ.pack(peer))
        except OSError:
            break
        made += 1
    return made
