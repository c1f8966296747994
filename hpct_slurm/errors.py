"""The one error type users see: a message that names what was wrong."""


class HpctError(Exception):
    """A clear, single-line error. The CLI prints it as `HPCT: <message>` and exits 2."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"HPCT: {self.message}"
