"""This process's TCP sockets as Linux shows them (/proc/self/net/tcp and tcp6, /proc/self/fd),
and how another thread ends one: what recovery/sever.py (the connections to a lost node) and
rendezvous/gloo_wake.py (a stopped formation's connects in flight) both need. `rows` and the
decoders are pure; `tables`, `own_socket_fds` and `shut_down` do the I/O."""
from __future__ import annotations

import ipaddress
import os
import socket
from typing import NamedTuple

# /proc/net/tcp's connection states (the kernel's numbering, in hex)
SYN_SENT = "02"
LISTEN = "0A"


def decode_addr(hex_addr: str) -> str:
    """'0100007F:1F90' (IPv4) or a 32-digit IPv6 address, as /proc/net/tcp* writes them
    (each 32-bit word in host byte order), to the address text without the port; an
    IPv4-mapped IPv6 address as its IPv4 address."""
    host = hex_addr.split(":", 1)[0]
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    if len(raw) == 16:
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        addr = ipaddress.IPv6Address(words)
        return str(addr.ipv4_mapped or addr)
    raise ValueError(f"not a /proc/net/tcp address: {hex_addr!r}")


def decode_port(hex_addr: str) -> int:
    """The port of a /proc/net/tcp* 'ADDR:PORT'."""
    return int(hex_addr.rsplit(":", 1)[1], 16)


class Row(NamedTuple):
    """One socket of a /proc/net/tcp* table."""
    state: str
    local_port: int
    remote: str       # address text (decode_addr)
    remote_port: int
    inode: int


def rows(table: str) -> list[Row]:
    """The sockets of a /proc/net/tcp or tcp6 `table`'s text; a line that does not read as one
    is left out."""
    out = []
    for line in table.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        try:
            out.append(Row(f[3], decode_port(f[1]), decode_addr(f[2]), decode_port(f[2]),
                           int(f[9])))
        except (ValueError, IndexError):
            continue
    return out


def tables() -> list[str]:
    """The texts of /proc/self/net/tcp and tcp6 (this process's network namespace)."""
    out = []
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path) as f:
                out.append(f.read())
        except OSError:
            continue  # no IPv6 here
    return out


def own_socket_fds() -> dict[int, int]:
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


def shut_down(fd: int, inode: int) -> bool:
    """Shut down the socket on this process's descriptor `fd` if it is still socket `inode`
    (its owner may have closed it since it was listed, and the number may name another socket
    now): pending reads and connects on it fail at once. A duplicate is shut down and closed;
    the descriptor itself stays its owner's to close."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False  # closed meanwhile
    with s:
        try:
            if os.fstat(s.fileno()).st_ino != inode:
                return False
            s.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
