"""Work a rank starts now and waits for later, with a bound: the broken group's teardown runs
while the controller decides and the replacement pulls its state, instead of before the rank
reports ready (recovery/job.py)."""
from __future__ import annotations

import threading
from typing import Callable


class Background:
    """`work()` on its own daemon thread; `wait(timeout)` gives its exception, a TimeoutError
    when it is still running after `timeout` seconds, or None when it finished."""

    def __init__(self, name: str, work: Callable[[], None]):
        self._error: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                self._error = exc

        self._thread = threading.Thread(target=run, daemon=True, name=name)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float) -> BaseException | None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            return TimeoutError(f"{self._thread.name} still running after {timeout:.0f} s")
        return self._error
