"""The controller's port: a listening socket and the task that accepts on it.

Not `asyncio.start_server`: out of descriptors, its accept callback (Python 3.11) goes on
through the rest of its backlog-long loop after the first EMFILE, logging "socket.accept()
out of system resource" and scheduling one more retry each time: 28-37k records in 6 s while
another user held a crowd of connections to the port. Here one task accepts, pauses when
accepting fails (accept_pause.py: at most 1 s, one `controller.accept_failed` per 30 s) and
accepts again; the connections it already has, and the watchdog, go on meanwhile.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Awaitable, Callable

from ..accept_pause import AcceptPause
from ..events import Ev, EventLog

BACKLOG = 1024

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Listener:
    """Accepts on `host` (an ephemeral port: `address`) and runs `serve(reader, writer)` for
    each connection, on the running loop, until `close`."""

    def __init__(self, host: str, serve: Serve, events: EventLog):
        self._serve, self._events = serve, events
        self._sock = socket.create_server((host, 0), backlog=BACKLOG)
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._conns: set[asyncio.Task] = set()  # held: the loop keeps only weak references
        self._task = asyncio.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        pause = AcceptPause(lambda **f: self._events.emit(Ev.CONTROLLER_ACCEPT_FAILED, **f),
                            self._events)
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                await asyncio.sleep(pause.failed(exc))
                continue
            pause.accepted()
            task = asyncio.create_task(self._open(sock))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _open(self, sock: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=sock)
        except OSError:  # it was reset before its transport was made: nothing to serve
            sock.close()
            return
        await self._serve(reader, writer)

    def close(self) -> None:
        """Stop accepting (the connections accepted go on until they end)."""
        self._task.cancel()
        with contextlib.suppress(OSError):
            self._sock.close()
