"""Wake this rank's gloo pairs that wait, in native code, for a peer that will never connect.

gloo forms its full mesh in `init_process_group`: after the address exchange every rank
connects its pairs one after another, and on the side of a pair that listens, gloo waits for
the peer to connect up to 5x the pair's timeout (`tcp/pair.h`, "Connect timeout"), in C++,
with the GIL released: nothing in Python can interrupt it, and the store's abort no longer
reaches it (the exchange is over). A member that died after the exchange therefore held every
survivor there for 5 x 10 s (issue 30) while the controller waited for their ready reports.

The wake uses gloo's own handshake instead (torch 2.13's gloo, `tcp/listener.cc`,
`tcp/context.cc`): a connecting peer opens a TCP connection to the listener's address and
writes one 8-byte sequence number, the one the listening rank published for that peer, and
the listener hands the socket to the pair waiting under that number. On a STOP for the
generation being formed, this rank connects to its *own* listener once per peer, writes the
number it published for that peer, and closes the connection: every pair still waiting is
"connected" to a socket already closed, `connectFullMesh` returns (or fails at once), and
the rank goes to recovery as it does from a store aborted earlier in the formation (the
caller checks the STOP right after init). Pairs already connected are untouched: the listener
keeps the extra socket unused until the group is destroyed. Only this process's own listener
is ever contacted, and only for a formation the controller has already stopped.

That reaches the pairs that listen. A pair whose side *connects* waits in gloo's connect
loop instead: where the network drops its SYNs (a link or a firewall breaking one pair, both
nodes alive), the kernel retransmits and gloo waits 5x the pair timeout again. So the wake
also resets this process's own connections still in SYN_SENT to a member's listener
(`reset_connects`: /proc/self/net/tcp{,6} gives their inodes, /proc/self/fd the descriptors,
read by proc_tcp.py as for sever.py; shutdown() of a dup ends the connect with ECONNRESET).
gloo retries a failed connect up to 3 times (`tcp/helpers.cc`, ConnectOperation's maxRetries),
each a new socket: every attempt is reset as it appears, and the fourth failure fails the
formation at once. Measured on loopback with the SYNs to one listener dropped (torch 2.13):
20.4 s (5 x a 4 s timeout) before, 0.2 s after the STOP.

What this rank published (gloo's `tcp::Rank::bytes`, read back by `parse`):
  u64 hostname size | hostname | u64 address size | sockaddr_storage (128) + u64 seq (-1) |
  one ssize_t pair sequence number per rank (none when GLOO uses ranks as sequence numbers)
Anything else (another gloo, another transport) is refused by `parse` with the reason, and the
rank then waits out gloo's own timeout as before: the wake is an optimisation, never a
dependency.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import ipaddress
import selectors
import socket
import struct
import time
from collections.abc import Callable, Iterable

from .. import proc_tcp

_U64 = struct.Struct("=Q")
_SOCKADDR_STORAGE = 128
_ADDRESS_SIZE = _SOCKADDR_STORAGE + _U64.size  # tcp::Address: sockaddr_storage + sequence
_MAX_HOSTNAME = 1024
# The whole wake, every peer together: it runs on the thread that reads the controller's
# connection, and one connect at a time with 1 s each took 5 s for 6 peers whose listener's
# backlog was full. Connections go out in parallel, at most PARALLEL at a time (each is a
# descriptor).
WAKE_S = 1.0
PARALLEL = 64


@dataclasses.dataclass(frozen=True)
class Published:
    """One rank's gloo addresses: its listener and its pairs' sequence numbers."""
    hostname: str
    host: str
    port: int
    pair_seqs: tuple[int, ...]  # empty: gloo uses the connecting rank as the number

    def seq_for(self, peer: int) -> int:
        """The number peer `peer` would write when connecting to this rank."""
        return self.pair_seqs[peer] if self.pair_seqs else peer


def parse(raw: bytes, world_size: int) -> Published:
    """What one rank wrote for gloo's full mesh. ValueError naming what does not fit."""
    off = 0

    def u64(what: str) -> int:
        nonlocal off
        if off + _U64.size > len(raw):
            raise ValueError(f"gloo rank info ends before its {what} ({len(raw)} bytes)")
        (value,) = _U64.unpack_from(raw, off)
        off += _U64.size
        return value

    name_size = u64("hostname size")
    if name_size > _MAX_HOSTNAME or off + name_size > len(raw):
        raise ValueError(f"gloo rank info: hostname size {name_size} does not fit "
                         f"{len(raw)} bytes")
    hostname = raw[off:off + name_size].decode("utf-8", "replace")
    off += name_size
    addr_size = u64("address size")
    if addr_size != _ADDRESS_SIZE or off + addr_size > len(raw):
        raise ValueError(f"gloo rank info: an address of {addr_size} bytes, not the "
                         f"{_ADDRESS_SIZE} of gloo's tcp transport")
    sa = raw[off:off + _SOCKADDR_STORAGE]
    off += addr_size
    (family,) = struct.unpack_from("=H", sa, 0)
    (port,) = struct.unpack_from("!H", sa, 2)
    if family == socket.AF_INET:
        host = str(ipaddress.IPv4Address(sa[4:8]))
    elif family == socket.AF_INET6:
        host = str(ipaddress.IPv6Address(sa[8:24]))
    else:
        raise ValueError(f"gloo rank info: address family {family} is neither IPv4 nor IPv6")
    if not 0 < port < 65536:
        raise ValueError(f"gloo rank info: listener port {port}")
    rest = len(raw) - off
    if rest % _U64.size:
        raise ValueError(f"gloo rank info: {rest} trailing bytes are not whole sequence numbers")
    count = rest // _U64.size
    if count not in (0, world_size):
        raise ValueError(f"gloo rank info: {count} pair sequence numbers for a world of "
                         f"{world_size}")
    seqs = struct.unpack_from(f"={count}q", raw, off) if count else ()
    return Published(hostname, host, port, tuple(seqs))


def wake(own: Published, rank: int, peers: Iterable[int], timeout_s: float = WAKE_S) -> int:
    """Connect to this rank's own listener as each of `peers` would, and hang up at once; in
    parallel (at most PARALLEL connections at a time), all of it within `timeout_s`. Returns
    how many were delivered (a refused one, or one not connected by then, is skipped: the
    listener is gone with its group, or the pair waits out its own timeout as before)."""
    deadline = time.monotonic() + timeout_s
    todo = collections.deque(p for p in peers if p != rank)
    family = socket.AF_INET6 if ":" in own.host else socket.AF_INET
    woken = 0
    with selectors.DefaultSelector() as sel:
        try:
            while todo or sel.get_map():
                while todo and len(sel.get_map()) < PARALLEL:
                    peer = todo.popleft()
                    s = _connecting(family, own)
                    if s is not None:
                        sel.register(s, selectors.EVENT_WRITE, peer)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for key, _ in sel.select(left):
                    sel.unregister(key.fileobj)
                    woken += _deliver(key.fileobj, own.seq_for(key.data))
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()
    return woken


def _connecting(family: int, own: Published) -> socket.socket | None:
    """A non-blocking connection to `own`'s listener, on its way; None if it cannot be
    started (out of descriptors, the address refused at once)."""
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return None
    s.setblocking(False)
    if s.connect_ex((own.host, own.port)) not in (0, errno.EINPROGRESS):
        s.close()
        return None
    return s


def _deliver(s: socket.socket, seq: int) -> int:
    """1 when the connection `s` (writable: connected, or failed) took the number."""
    with s:
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                return 0
            # 8 bytes into an empty socket buffer: never a partial send
            if s.send(_U64.pack(seq & 0xFFFFFFFFFFFFFFFF)) != _U64.size:
                return 0
            s.shutdown(socket.SHUT_RDWR)
            return 1
        except OSError:
            return 0


# ---- the side that connects ----------------------------------------------------------------
# Between two looks at this process's connections: gloo opens its next attempt within
# microseconds of a failed one; an empty look repeated once means it has none in flight.
RESET_POLL_S = 0.01
Endpoint = tuple[str, int]  # (address text as proc_tcp.decode_addr writes it, port)


def endpoint(host: str, port: int) -> Endpoint:
    """A comparable (address, port): an IPv4-mapped IPv6 address is its IPv4 address."""
    addr = ipaddress.ip_address(host)
    return str(getattr(addr, "ipv4_mapped", None) or addr), port


def listeners(values: Iterable[bytes], world_size: int, rank: int) -> set[Endpoint]:
    """The listeners of every other rank's published gloo addresses (`values`, in rank order);
    one that does not parse is left out (its pair waits out gloo's own timeout)."""
    out = set()
    for peer, raw in enumerate(values):
        if peer == rank:
            continue
        try:
            p = parse(raw, world_size)
        except ValueError:
            continue
        out.add(endpoint(p.host, p.port))
    return out


def connecting(tables: Iterable[str], own: dict[int, int],
               targets: set[Endpoint]) -> list[tuple[int, int]]:
    """(descriptor, inode) of this process's connections (`own`: socket inode -> fd) in
    `tables` (/proc/net/tcp and tcp6 texts) still in SYN_SENT to one of `targets`."""
    return [(own[r.inode], r.inode) for table in tables for r in proc_tcp.rows(table)
            if r.state == proc_tcp.SYN_SENT and r.inode in own
            and (r.remote, r.remote_port) in targets]


def reset_connects(targets: set[Endpoint], forming: Callable[[], bool],
                   timeout_s: float = WAKE_S) -> int:
    """Reset this process's connections in SYN_SENT to `targets` as they appear, while
    `forming()` and within `timeout_s`, until two looks in a row find none; how many."""
    if not targets:
        return 0
    deadline = time.monotonic() + timeout_s
    reset = idle = 0
    while forming() and idle < 2 and time.monotonic() < deadline:
        found = connecting(proc_tcp.tables(), proc_tcp.own_socket_fds(), targets)
        idle = 0 if found else idle + 1
        reset += sum(proc_tcp.shut_down(fd, inode) for fd, inode in found)
        time.sleep(RESET_POLL_S)
    return reset
