"""Cut this process's TCP connections to lost nodes, so a collective blocked on them fails now.

Stock gloo has no abort. A peer that died with its kernel (a node crash) or behind a cut link
sends no FIN or RST, so a survivor blocked in a collective with it waits for the collective
timeout (10 s by default) before it can tear down. The controller names the lost nodes'
addresses in its STOP; shutting down our own end of every connection to them makes gloo's
pending reads fail at once ("connection closed"), exactly as if the peer had died cleanly.
Only sockets of this process are touched, found through /proc/self.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable

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


def socket_inodes_to(table: str, remotes: set[str], outbound: set[str] = frozenset(),
                     own_inodes: set[int] = frozenset()) -> set[int]:
    """Inodes of the connections in a /proc/net/tcp or tcp6 `table` whose remote address is in
    `remotes`, and of those to an address in `outbound` that this process opened: whose local
    port is none of the ports it listens on (`own_inodes`: its sockets' inodes, to tell its
    listeners in the table). Pure: the table's text in, inodes out."""
    rows = []
    for line in table.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        try:
            rows.append((f[3], _decode_addr(f[2]), int(f[1].rsplit(":", 1)[1], 16), int(f[9])))
        except (ValueError, IndexError):
            continue
    listening = {port for st, _, port, inode in rows if st == _LISTEN and inode in own_inodes}
    return {inode for st, remote, port, inode in rows
            if st != _LISTEN and inode and (remote in remotes or
                                            (remote in outbound and port not in listening))}


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
          keep_fds: Iterable[int] = (), outbound: Iterable[str] = ()) -> int:
    """Shut down every TCP connection of this process to `addresses` (but never to `keep`,
    e.g. this node's own address, which in a one-host test cluster every node shares, and
    never the sockets `keep_fds`: the connection to the controller, which lives on the batch
    host, a node whose rank may be the one lost). To `outbound` addresses (this node's own,
    where it runs ranks of the same group: a TP pair), only the connections this process
    opened are cut: each connection between two of the node's ranks is opened by one of them,
    so every pair is cut from one end, while what others opened to this process's servers
    (a node relay's ranks) stays. Returns how many were cut. Raises only ValueError for an
    address that is not one; a failure to cut costs only the old wait."""
    remotes = {str(ipaddress.ip_address(a)) for a in addresses} - {str(k) for k in keep}
    local = {str(ipaddress.ip_address(a)) for a in outbound}
    if not remotes and not local:
        return 0
    own = _own_socket_fds()
    inodes: set[int] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                inodes |= socket_inodes_to(f.read(), remotes, local, set(own))
        except OSError:
            continue
    cut = 0
    spared = set(keep_fds)
    for inode, fd in own.items():
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
