"""The one error type users see: a message that names what was wrong."""
from __future__ import annotations

from collections.abc import Mapping


class HpctError(Exception):
    """A clear, single-line error. The CLI prints it as `HPCT: <message>` and exits 2."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"HPCT: {self.message}"


def seconds_from_env(env: Mapping[str, str], name: str, default: float) -> float:
    """$name as a positive number of seconds, `default` when unset; anything else is an error
    naming the variable."""
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise HpctError(f"{name} {raw!r} is not a positive number of seconds")
    return value
