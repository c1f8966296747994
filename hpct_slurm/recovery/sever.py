"""Cut this process's TCP connections to lost nodes, so a collective blocked on them fails now.

Stock gloo has no abort. A peer that died with its kernel (a node crash) or behind a cut link
sends no FIN or RST, so a survivor blocked in a collective with it waits for the collective
timeout (10 s by default) before it can tear down. The controller names the lost nodes'
addresses in its STOP; shutting down our own end of every connection to them makes gloo's
pending reads fail at once ("connection closed"), exactly as if the peer had died cleanly.
Only sockets of this process are touched, found through /proc/self.

`sever_endpoints` cuts by endpoint instead of by address: one process group's connections
(pg.interrupt), which on a one-host test cluster share their address with everything else.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Iterable

# /proc/net/tcp connection states worth cutting: established, SYN sent, close-wait, etc.
# (0A, listening, is never a connection to a peer)
_LISTEN = "0A"


def _decode_addr(hex_addr: str) -> str:
    """'0100007F:1F90' (IPv4) or a 32-digit IPv6 address, as /proc/net/tcp* writes them
    (each 32-bit word in host byte order), to the address text without the port."""
    host = hex_addr.split(":", 1)[0]
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    if len(raw) == 16:
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        addr = ipaddress.IPv6Address(words)
        return str(addr.ipv4_mapped or addr)
    raise ValueError(f"not a /proc/net/tcp address: {hex_addr!r}")


Endpoint = tuple[str, int]


def _decode_endpoint(hex_addr: str) -> Endpoint:
    return _decode_addr(hex_addr), int(hex_addr.rsplit(":", 1)[1], 16)


def socket_inodes_where(table: str, match: Callable[[Endpoint, Endpoint], bool]) -> set[int]:
    """Inodes of the connections in a /proc/net/tcp or tcp6 `table` for which
    `match(local, remote)` holds, each an (address, port) (pure: the table's text in, inodes
    out). Listening sockets and sockets already gone (inode 0) never count."""
    out = set()
    for line in table.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or f[3] == _LISTEN:
            continue
        try:
            local, remote = _decode_endpoint(f[1]), _decode_endpoint(f[2])
            inode = int(f[9])
        except ValueError:
            continue
        if inode and match(local, remote):
            out.add(inode)
    return out


def socket_inodes_to(table: str, remotes: set[str]) -> set[int]:
    """Inodes of the connections in `table` whose remote address is in `remotes`."""
    return socket_inodes_where(table, lambda local, remote: remote[0] in remotes)


def _own_socket_fds() -> dict[int, int]:
    """inode -> fd for every socket this process holds."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            fds[int(target[8:-1])] = int(name)
    return fds


def sever(addresses: Iterable[str], keep: Iterable[str] = (),
          keep_fds: Iterable[int] = ()) -> int:
    """Shut down every TCP connection of this process to `addresses` (but never to `keep`,
    e.g. this node's own address, which in a one-host test cluster every node shares, and
    never the sockets `keep_fds`: the connection to the controller, which lives on the batch
    host, a node whose rank may be the one lost). Returns how many were cut. Raises only
    ValueError for an address that is not one; a failure to cut costs only the old wait."""
    remotes = {str(ipaddress.ip_address(a)) for a in addresses} - {str(k) for k in keep}
    if not remotes:
        return 0
    return _shut_down(_own_inodes(lambda local, remote: remote[0] in remotes), keep_fds)


def sever_endpoints(locals_: Iterable[Endpoint], remotes: Iterable[Endpoint]) -> int:
    """Shut down every TCP connection of this process whose local endpoint is in `locals_`
    (connections a listener of ours accepted) or whose remote endpoint is in `remotes`
    (connections we made to those listeners). Returns how many were cut."""
    mine = {(str(ipaddress.ip_address(a)), int(p)) for a, p in locals_}
    theirs = {(str(ipaddress.ip_address(a)), int(p)) for a, p in remotes}
    if not mine and not theirs:
        return 0
    return _shut_down(_own_inodes(lambda local, remote: local in mine or remote in theirs), ())


def _own_inodes(match: Callable[[Endpoint, Endpoint], bool]) -> set[int]:
    inodes: set[int] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                inodes |= socket_inodes_where(f.read(), match)
        except OSError:
            continue
    return inodes


def _shut_down(inodes: set[int], keep_fds: Iterable[int]) -> int:
    cut = 0
    spared = set(keep_fds)
    for inode, fd in _own_socket_fds().items():
        if inode not in inodes or fd in spared:
            continue
        try:
            # a duplicate of the fd: shutdown acts on the shared socket, close only on the copy
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            s.close()
    return cut
