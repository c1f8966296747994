"""Slurm hostlists in pure Python: `n[001-003],rack[1-2]-m[1-2]` <-> a list of host names.

`expand` follows Slurm 22.05's `hostlist_create` for every input it accepts, including two
details that are easy to get wrong:

* Zero padding comes from the low bound's text: `n[01-3]` is n01 n02 n03, `n[1-03]` is n1 n2 n3.
* Several bracket groups form a product, but in Slurm's loop order, not lexicographic order:
  the last group varies fastest, then the first, second, ... up to the one before last, which
  varies slowest (`a[1-2]b[3-4]c[5-6]` starts a1b3c5 a1b3c6 a2b3c5).
* Text may follow the last group: `n[1-2]-ib` is n1-ib n2-ib, as `scontrol show hostnames`
  gives from Slurm 23.02 on (24.11 and 26.05 were run; interface-suffixed names that real
  clusters use). Slurm 22.05 refused it ("Invalid hostlist").

Where Slurm quietly guesses (`n[1-` becomes the host `n]`, `n[1-]` means `n1`, spaces inside
brackets count as padding) this module refuses with an error instead: a node list that needs
guessing is a bug upstream, and the earliest clear error is the cheapest. Numbers are ASCII
digits only (as in Slurm), and a list is measured before it is built: more than MAX_HOSTS hosts
or names longer than MAX_HOST_NAME are refused, so one argument cannot exhaust memory.

`compress` keeps order and duplicates, so `expand(compress(hosts)) == hosts` always holds; its
text may differ from `scontrol show hostlist` (which merges differently) but expands the same.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Iterable

from ..errors import HpctError, shown

# Slurm's MAX_RANGE: a larger range is taken as a typo rather than a real cluster.
MAX_RANGE = 64 * 1024
# The most hosts one hostlist may name, however it is written (a product of bracket groups,
# many tokens): counted before anything is built, so one argument cannot take gigabytes.
MAX_HOSTS = MAX_RANGE
# A DNS name is at most 255 characters; longer "host names" are garbage (and int() of thousands
# of digits is slow, then refused by Python itself).
MAX_HOST_NAME = 255

_SEPARATORS = ", \t"
# ASCII digits only: \d, str.isdigit and int() also take '١' and '１', which Slurm refuses.
_RANGE_RE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TRAILING_NUMBER_RE = re.compile(r"(.*?)([0-9]+)")
_FORBIDDEN_IN_HOST = set("[]" + _SEPARATORS + "\n")


def _bad(hostlist: str, why: str) -> HpctError:
    return HpctError(f"hostlist {shown(hostlist)} is not a hostlist: {why}")


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
        elif (ch < " " and ch != "\t") or ch == "\x7f":
            raise _bad(hostlist, f"it contains the control character {ch!r}")
        elif ch in _SEPARATORS and ch != ",":
            raise _bad(hostlist, "whitespace inside '[...]'")
        current.append(ch)
    if depth:
        raise _bad(hostlist, "unclosed '['")
    if current:
        tokens.append("".join(current))
    return tokens


@dataclass(frozen=True)
class _Range:
    """lo..hi of one bracket part, each number printed with at least `width` digits."""

    lo: int
    hi: int
    width: int

    @property
    def count(self) -> int:
        return self.hi - self.lo + 1

    @property
    def max_len(self) -> int:
        return max(self.width, len(str(self.hi)))


def _parse_ranges(hostlist: str, body: str) -> list[_Range]:
    """The parts of one bracket body such as `01-03,7`, checked, not yet expanded."""
    ranges: list[_Range] = []
    for part in body.split(","):
        m = _RANGE_RE.fullmatch(part)
        if not m:
            raise _bad(hostlist, f"range {shown(part)} is not N or N-M with decimal numbers "
                                 f"(ASCII digits 0-9)")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        if max(len(lo_text), len(hi_text)) > MAX_HOST_NAME:
            raise _bad(hostlist, f"range {shown(part)} has a number longer than "
                                 f"{MAX_HOST_NAME} digits")
        lo, hi = int(lo_text), int(hi_text)
        if lo > hi:
            raise _bad(hostlist, f"range {shown(part)} counts down")
        if hi - lo + 1 > MAX_RANGE:
            raise _bad(hostlist, f"range {shown(part)} has more than {MAX_RANGE} hosts")
        # Zero padding comes from the low bound's text only.
        ranges.append(_Range(lo, hi, len(lo_text)))
    return ranges


@dataclass(frozen=True)
class _Token:
    """One top-level item, checked, not yet expanded: literal texts and bracket groups
    alternating, literal first and last (with groups, the last literal is the text after the
    last ']', often empty)."""

    literals: list[str]
    groups: list[list[_Range]]

    @property
    def count(self) -> int:
        return math.prod(sum(r.count for r in group) for group in self.groups)

    @property
    def max_name_len(self) -> int:
        return (sum(len(lit) for lit in self.literals)
                + sum(max(r.max_len for r in group) for group in self.groups))

    def hosts(self) -> list[str]:
        if not self.groups:
            return ["".join(self.literals)]
        values = [[str(n).zfill(r.width) for r in group for n in range(r.lo, r.hi + 1)]
                  for group in self.groups]
        k = len(self.groups)
        # Slurm's loop order, outermost first: group k-1, k-2, ..., 1, then group k innermost.
        order = list(range(k - 2, -1, -1)) + [k - 1]
        hosts = []
        for combo in itertools.product(*(values[i] for i in order)):
            chosen = [""] * k
            for i, v in zip(order, combo):
                chosen[i] = v
            hosts.append("".join(lit + num for lit, num in zip(self.literals, chosen))
                         + self.literals[-1])
        return hosts


def _parse_token(hostlist: str, token: str) -> _Token:
    pieces = re.split(r"\[([^\]]*)\]", token)
    # pieces alternates literal, group, literal, ..., literal (text after the last ']').
    literals, groups = pieces[0::2], pieces[1::2]
    parsed = _Token(literals, [_parse_ranges(hostlist, g) for g in groups])
    if parsed.max_name_len > MAX_HOST_NAME:
        raise _bad(hostlist, f"{shown(token)} makes host names longer than {MAX_HOST_NAME} "
                             f"characters")
    return parsed


def expand(hostlist: str) -> list[str]:
    """All host names of a Slurm hostlist, in Slurm's order, duplicates kept.

    Raises HpctError naming the hostlist for anything Slurm would reject or would have to
    guess, and for lists of more than MAX_HOSTS hosts (counted before any is built).
    """
    if not isinstance(hostlist, str):
        raise HpctError(f"hostlist {hostlist!r} is not a string")
    tokens = [_parse_token(hostlist, t) for t in _tokens(hostlist)]
    total = sum(t.count for t in tokens)
    if total > MAX_HOSTS:
        raise _bad(hostlist, f"it names {total} hosts, more than the {MAX_HOSTS} one "
                             f"hostlist may name")
    if not total:
        raise _bad(hostlist, "it names no host")
    return [host for t in tokens for host in t.hosts()]


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
    if (not host or len(host) > MAX_HOST_NAME or _FORBIDDEN_IN_HOST & set(host)
            or any(ch < " " or ch == "\x7f" for ch in host)):
        raise HpctError(f"host name {shown(host)} cannot be written in a hostlist (empty, "
                        f"longer than {MAX_HOST_NAME} characters, or holding a separator, "
                        f"a bracket or a control character)")
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
