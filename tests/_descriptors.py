"""This test process out of descriptors, for a while: what a server meets when another
user's crowd of connections, or the training's own files, fill its descriptor table."""
from __future__ import annotations

import contextlib
import errno
import os
import resource
from collections.abc import Iterator


@contextlib.contextmanager
def out_of_descriptors(room: int = 16) -> Iterator[None]:
    """Lower the soft limit to `room` above what is open, fill the table with /dev/null
    until EMFILE, and give everything back on the way out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (len(os.listdir("/proc/self/fd")) + room, hard))
    held: list[int] = []
    try:
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE, exc
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
