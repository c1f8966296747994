"""The one error type users see: a message that names what was wrong."""
from __future__ import annotations


class HpctError(Exception):
    """A clear, single-line error. The CLI prints it as `HPCT: <message>` and exits 2."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"HPCT: {self.message}"


class UsageError(HpctError):
    """A mistake in how the script uses hpct-slurm (a state registered twice, a name taken):
    the script's own error, raised where it is made. Never a fault to recover from in place:
    running the same code again would make the same mistake."""


def shown(text: str, limit: int = 60) -> str:
    """`text` quoted for an error message, cut short when long, so that a hostile value of
    megabytes still gives a one-line error."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def describe(exc: BaseException) -> str:
    """An exception as one line for a log: an HpctError's message, otherwise its type and text.
    The type is never dropped: `asyncio.TimeoutError()` has an empty str and would log ''."""
    if isinstance(exc, HpctError):
        return exc.message
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
