"""Slurm hostlists in pure Python: `n[001-003],rack[1-2]-m[1-2]` <-> a list of host names.

`expand` follows Slurm 22.05's `hostlist_create` for every input it accepts, including two
details that are easy to get wrong:

* Zero padding comes from the low bound's text: `n[01-3]` is n01 n02 n03, `n[1-03]` is n1 n2 n3.
* Several bracket groups form a product, but in Slurm's loop order, not lexicographic order:
  the last group varies fastest, then the first, second, ... up to the one before last, which
  varies slowest (`a[1-2]b[3-4]c[5-6]` starts a1b3c5 a1b3c6 a2b3c5). The last group must end
  its host name (`n[1-2]a` is an error in Slurm too).

Where Slurm quietly guesses (`n[1-` becomes the host `n]`, `n[1-]` means `n1`, spaces inside
brackets count as padding) this module refuses with an error instead: a node list that needs
guessing is a bug upstream, and the earliest clear error is the cheapest.

`compress` keeps order and duplicates, so `expand(compress(hosts)) == hosts` always holds; its
text may differ from `scontrol show hostlist` (which merges differently) but expands the same.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Iterable

from ..errors import HpctError

# Slurm's MAX_RANGE: a larger range is taken as a typo rather than a real cluster.
MAX_RANGE = 64 * 1024

_SEPARATORS = ", \t"
_RANGE_RE = re.compile(r"(\d+)(?:-(\d+))?")
_TRAILING_NUMBER_RE = re.compile(r"(.*?)(\d+)")
_FORBIDDEN_IN_HOST = set("[]" + _SEPARATORS + "\n")


def _bad(hostlist: str, why: str) -> HpctError:
    return HpctError(f"hostlist {hostlist!r} is not a hostlist: {why}")


def _tokens(hostlist: str) -> list[str]:
    """Split at top-level separators; commas inside brackets belong to the range list."""
    tokens: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in hostlist:
        if ch == "[":
            if depth:
                raise _bad(hostlist, "nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _bad(hostlist, "']' without '['")
            depth = 0
        elif ch in _SEPARATORS and not depth:
            if current:
                tokens.append("".join(current))
            current = []
            continue
        elif ch == "\n":
            raise _bad(hostlist, "it contains a newline")
        elif ch in _SEPARATORS and ch != ",":
            raise _bad(hostlist, "whitespace inside '[...]'")
        current.append(ch)
    if depth:
        raise _bad(hostlist, "unclosed '['")
    if current:
        tokens.append("".join(current))
    return tokens


def _range_values(hostlist: str, body: str) -> list[str]:
    """The formatted numbers of one bracket body such as `01-03,7`."""
    values: list[str] = []
    for part in body.split(","):
        m = _RANGE_RE.fullmatch(part)
        if not m:
            raise _bad(hostlist, f"range {part!r} is not N or N-M with decimal numbers")
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = int(hi_text) if hi_text is not None else lo
        if lo > hi:
            raise _bad(hostlist, f"range {part!r} counts down")
        if hi - lo + 1 > MAX_RANGE:
            raise _bad(hostlist, f"range {part!r} has more than {MAX_RANGE} hosts")
        width = len(lo_text)
        values.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return values


def _expand_token(hostlist: str, token: str) -> list[str]:
    pieces = re.split(r"\[([^\]]*)\]", token)
    # pieces alternates literal, group, literal, ...; a token with groups ends with a group.
    literals, groups = pieces[0::2], pieces[1::2]
    if not groups:
        return [token]
    if literals[-1]:
        raise _bad(hostlist, f"text {literals[-1]!r} follows the last ']' in {token!r}")
    values = [_range_values(hostlist, g) for g in groups]
    k = len(groups)
    # Slurm's loop order, outermost first: group k-1, k-2, ..., 1, then group k innermost.
    order = list(range(k - 2, -1, -1)) + [k - 1]
    hosts = []
    for combo in itertools.product(*(values[i] for i in order)):
        chosen = [""] * k
        for i, v in zip(order, combo):
            chosen[i] = v
        hosts.append("".join(lit + num for lit, num in zip(literals, chosen)))
    return hosts


def expand(hostlist: str) -> list[str]:
    """All host names of a Slurm hostlist, in Slurm's order, duplicates kept.

    Raises HpctError naming the hostlist for anything Slurm would reject or would have to guess.
    """
    if not isinstance(hostlist, str):
        raise HpctError(f"hostlist {hostlist!r} is not a string")
    hosts: list[str] = []
    for token in _tokens(hostlist):
        hosts.extend(_expand_token(hostlist, token))
    if not hosts:
        raise _bad(hostlist, "it names no host")
    return hosts


@dataclass
class _Run:
    """Consecutive hosts prefix+lo..prefix+hi printed with `width` digits (None: no number)."""

    prefix: str
    lo: int = 0
    hi: int = 0
    width: int | None = None

    def numbers(self) -> str:
        lo = str(self.lo).zfill(self.width or 0)
        return lo if self.lo == self.hi else f"{lo}-{str(self.hi).zfill(self.width or 0)}"


def _run_of(host: str) -> _Run:
    if not host or _FORBIDDEN_IN_HOST & set(host):
        raise HpctError(f"host name {host!r} cannot be written in a hostlist")
    m = _TRAILING_NUMBER_RE.fullmatch(host)
    if not m:
        return _Run(prefix=host)
    digits = m.group(2)
    return _Run(prefix=m.group(1), lo=int(digits), hi=int(digits), width=len(digits))


def compress(hosts: Iterable[str]) -> str:
    """A short hostlist for `hosts` that expands back to exactly `hosts` (order, duplicates),
    never longer than the names joined by commas. An empty iterable gives "".
    """
    runs: list[_Run] = []
    for host in hosts:
        run = _run_of(host)
        last = runs[-1] if runs else None
        if (last is not None and run.width is not None and last.width is not None
                and last.prefix == run.prefix and run.lo == last.hi + 1
                and str(run.lo).zfill(last.width) == host[len(run.prefix):]):
            last.hi = run.lo
        else:
            runs.append(run)
    parts: list[str] = []
    # Neighbouring numbered runs with one prefix share one bracket: n[1-3,7].
    for (prefix, numbered), group in itertools.groupby(
            runs, key=lambda r: (r.prefix, r.width is not None)):
        group = list(group)
        if not numbered:
            parts.extend(r.prefix for r in group)
        else:
            bracketed = f"{prefix}[{','.join(r.numbers() for r in group)}]"
            plain = ",".join(prefix + str(n).zfill(r.width or 0)
                             for r in group for n in range(r.lo, r.hi + 1))
            # A bracket only pays off from a few hosts on: n1,n2 is shorter than n[1-2].
            parts.append(bracketed if len(bracketed) < len(plain) else plain)
    return ",".join(parts)
