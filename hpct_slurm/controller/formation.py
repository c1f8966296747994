"""Whose fault a restart in place was: the script's, or the transport's (pure logic).

A restart in place with every member alive follows a fault some rank raised itself. Three
such restarts in a row at the same step end the job as the script's own error (policy.py):
running it again would only fail again. But gloo's TCP listener and pairs are not
authenticated (issue 45): a stranger who claims a pair at a formation, or a connection that
never sends gloo's handshake, breaks the formation again and again with every member alive,
and the ranks then report only the transport's errors (a pair closed or timed out, the store
not answering) and survivors stopped because of them. That is not the script's error and is
never charged to it: the round is named (`formation.broken`) and, at the limit, escalates
like any other infrastructure failure (requeue, per --on-no-spare).
"""
from __future__ import annotations

from typing import Iterable

# What the collective transport and the rendezvous raise, as `Job._describe` reports it
# ("<type>: <first line>"): gloo's errors name their source file under gloo/transport (a pair
# closed or reset by its peer, "Timed out waiting ... for recv", "Application timeout caused
# pair closure"); torch wraps backend (NCCL), network and store failures in these types; a
# TCPStore that does not answer says "Socket Timeout". Narrow on purpose: a script's own
# TimeoutError or ConnectionError (its data server) stays the script's.
TRANSPORT = ("gloo/transport", "DistBackendError", "DistNetworkError", "DistStoreError",
             "Socket Timeout")
# a survivor that left its step because the controller stopped the generation for another
# rank's fault (recovery/generation.py's _Stopped)
STOPPED = "_Stopped:"


def transport_error(error: str) -> bool:
    return any(marker in error for marker in TRANSPORT)


def broken_from_outside(errors: Iterable[str]) -> tuple[str, ...]:
    """The transport's errors when they are all a restart in place was about (every error
    the transport's, or a survivor stopped because of one, and at least one of them):
    nothing the script raised. Empty otherwise (the script's own error, or no error)."""
    errors = sorted({e for e in errors if e})
    own = [e for e in errors if not e.startswith(STOPPED)]
    if not own or not all(transport_error(e) for e in own):
        return ()
    return tuple(own)
