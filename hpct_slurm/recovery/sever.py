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
from collections.abc import Iterable

from ..proc_tcp import LISTEN, own_socket_fds, rows, shut_down, tables


def socket_inodes_to(table: str, remotes: set[str], outbound: set[str] = frozenset(),
                     own_inodes: set[int] = frozenset()) -> set[int]:
    """Inodes of the connections in a /proc/net/tcp or tcp6 `table` whose remote address is in
    `remotes`, and of those to an address in `outbound` that this process opened: whose local
    port is none of the ports it listens on (`own_inodes`: its sockets' inodes, to tell its
    listeners in the table). Pure: the table's text in, inodes out."""
    sockets = rows(table)
    listening = {r.local_port for r in sockets if r.state == LISTEN and r.inode in own_inodes}
    # every state but listening: established, SYN sent, close-wait, ...
    return {r.inode for r in sockets
            if r.state != LISTEN and r.inode and (
                r.remote in remotes or (r.remote in outbound and r.local_port not in listening))}


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
    own = own_socket_fds()
    inodes: set[int] = set()
    for table in tables():
        inodes |= socket_inodes_to(table, remotes, local, set(own))
    spared = set(keep_fds)
    return sum(shut_down(fd, inode) for inode, fd in own.items()
               if inode in inodes and fd not in spared)
