"""BackgroundQueue: the one queue-draining thread behind the persister, pusher and sealer."""
from __future__ import annotations

import threading

import pytest

from hpct_slurm.recovery.worker import BackgroundQueue


def test_items_are_handled_in_order_and_flush_waits_for_them():
    got: list[int] = []
    q: BackgroundQueue[int] = BackgroundQueue("t-order", got.append)
    for i in range(50):
        q.put(i)
    q.flush()
    assert got == list(range(50))
    q.close()
    assert not q._thread.is_alive()


def test_a_full_queue_drops_without_waiting_when_asked():
    taken, gate, got = threading.Event(), threading.Event(), []

    def handle(i: int) -> None:
        taken.set()
        gate.wait(5)
        got.append(i)

    q: BackgroundQueue[int] = BackgroundQueue("t-full", handle, maxsize=1)
    assert q.put(1)
    assert taken.wait(5)  # the thread holds 1: one place left
    assert q.put(2, wait=False)
    assert not q.put(3, wait=False)
    gate.set()
    q.close()
    assert got == [1, 2]


def test_a_handler_bug_is_raised_by_the_next_flush_and_the_thread_goes_on(monkeypatch):
    seen: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))

    def handle(i: int) -> None:
        if i == 1:
            raise ValueError("bug")
        got.append(i)

    got: list[int] = []
    q: BackgroundQueue[int] = BackgroundQueue("t-bug", handle)
    q.put(1)
    q.put(2)
    with pytest.raises(ValueError, match="bug"):
        q.flush()
    assert got == [2] and len(seen) == 1
    q.flush()  # raised once
    q.put(3)
    q.close()
    assert got == [2, 3]


def test_lazy_starts_with_the_first_item():
    got: list[int] = []
    q: BackgroundQueue[int] = BackgroundQueue("t-lazy", got.append, lazy=True)
    assert q._thread is None
    q.close()  # nothing started, nothing to stop
    q.put(7)
    q.flush()
    assert got == [7]
