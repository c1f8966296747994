"""One daemon thread working through a queue, in order: the shape shared by the disk persister
(persist.py), the replica pusher (transfer.py) and the snapshot sealer (slots.py).

Each hands `BackgroundQueue` a handler and chooses how a full queue behaves (`put(wait=...)`);
the queue does the rest once: starting the thread (now or at the first item), `flush` (wait
until everything queued so far is handled), `close` (flush, then end the thread; bounded if
asked) and errors.
A handler reports the failures it expects itself (an event: a failed save or push does not
stop training); anything else it lets escape is a bug: reported at once (`threading.excepthook`,
as for any thread), kept and raised again by the next `flush` or `close` in the caller's
thread, and the thread goes on with the next item, so a `flush` never waits for a thread that
has died.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
_STOP = object()


def lower_priority(by: int) -> bool:
    """Raise the calling thread's nice value by `by` (at most to 19): the scheduler then gives
    it a core mostly where the threads at the usual priority leave one idle. Linux keeps a nice
    value per thread (setpriority(2) with the thread's id; POSIX would make it the process's),
    and no unprivileged thread may lower it back. Whether it took."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError:
        return False
    return True


class BackgroundQueue(Generic[T]):
    """Items handled one at a time by one daemon thread named `name`. `maxsize`: how many may wait
    (0: unbounded). `lazy`: start the thread with the first `put` rather than now. `nice`:
    the thread's nice value raised by this much before it handles anything (lower_priority)."""

    def __init__(self, name: str, handle: Callable[[T], None], maxsize: int = 0,
                 lazy: bool = False, nice: int = 0):
        self.name = name
        self.nice = nice
        self._handle = handle
        self._queue: queue.Queue[object] = queue.Queue(maxsize)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        if not lazy:
            self._start()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def put(self, item: T, wait: bool = True) -> bool:
        """Queue `item`. With `wait` False and the queue full, drop it and return False; with
        `wait`, wait for room."""
        self._start()
        try:
            self._queue.put(item, block=wait)
        except queue.Full:
            return False
        return True

    def _loop(self) -> None:
        if self.nice:
            lower_priority(self.nice)
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._handle(item)  # type: ignore[arg-type]
            except Exception as exc:  # a bug in the handler
                threading.excepthook(threading.ExceptHookArgs(
                    (type(exc), exc, exc.__traceback__, threading.current_thread())))
                if self._error is None:
                    self._error = exc
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        exc, self._error = self._error, None
        if exc is not None:
            raise exc

    def flush(self) -> None:
        """Wait until every item queued so far has been handled."""
        self._queue.join()
        self._raise()

    def close(self, timeout: float | None = None) -> bool:
        """Handle what is queued, then end the thread. With `timeout`: wait at most so long
        for room to queue the stop, and as long for the thread; whether it ended."""
        if self._thread is not None:
            try:
                self._queue.put(_STOP, timeout=timeout)
            except queue.Full:
                return False
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        self._raise()
        return True
