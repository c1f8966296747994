"""Replicas check each other: ranks that hold the same shared state (one shard key) compare a
checksum of it at every full commit, so one node's silent data corruption (a flipped bit in a
weight, a bad DIMM, a GPU computing wrong) is found within one full-commit interval instead
of training on for the rest of the run, and so are bugs of ours that let replicas drift.

What is compared: a 16-byte digest of the committed step's shared state, made on the live
tensors at the step's end (they are the committed state then): each parameter's and each
optimizer state tensor's bytes summed as 64-bit words (wrapping; a last partial word byte by
byte) on the tensor's own device (memory bandwidth: 10 ms for 100 MB on one core here, no copy
to the host on a GPU; summed byte by byte it was 0.38 s), the sums and the state's
structure (its encoded tree, scalars included, less a shard's mesh coordinate) hashed
together. Buffers count by dtype and shape only: BatchNorm's running statistics are updated
from each rank's own batch, and DDP makes them equal only at the next forward (its buffer
broadcast), so replicas hold different ones at a step's end. It finds any single flipped bit, and all but
pathological combinations of several (two flips that cancel exactly); it is no defence
against a process that lies, which the job's secret and the transfer checksums cover.

The digests travel in one all-gather of the whole group (16 bytes a rank). Each shard key's
ranks agree, or those that differ from the key's strict majority are named (`replica.diverged`).
Then every step since the last agreeing commit is suspect on every rank, whose gradients the
diverging rank took part in: every rank drops its snapshots newer than that commit and the step
fails in place; the group restores the last agreeing commit (each rank's own, pinned), and a
diverging rank asks the controller to move its node out (`move_requests.ask_move`), which
continues its ranks on a warm spare and drains the node with the reason. With no strict
majority (two replicas that differ) the rollback happens and nobody is moved: which one is
wrong cannot be told.

What the check assumes: replicas that started equal and saw the same gradients compute the
same bits. Where they do not (one node's torch dispatching its CPU kernels at another level,
a nondeterministic op) the replicas differ at every comparison, and a rollback's recompute
differs again, where a flip happens once and its recompute agrees. So one rollback is tried
after a disagreement (`judge`); a disagreement that comes back at the next comparison turns
the check off for the rest of the run (`replica.check_off`) instead of rolling back for
ever. A node is blamed (moved out, drained) only where its replicas had agreed at some
comparison before: before any agreement the nodes may be healthy and only compute
differently. The group's memory of this (`History`) travels with the digests, so a rank
that joined later judges as the others do.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .proof import tree_digest
from .state import TrainState


def shared_digest(state: TrainState) -> bytes:
    """The digest of the shared state registered now (see the module docstring): the
    proof's digest of its tree (proof.py, which leaves a shard's coordinate out), with a
    word sum for each parameter and optimizer tensor and nothing for a buffer's values."""
    layout, tensors = state.plan(("shared",), rng=False)
    kept = state.stable_ptrs()

    def content(t: torch.Tensor) -> bytes:
        if not t.numel() or t.data_ptr() not in kept:
            return b""
        return _word_sum(t).to_bytes(9, "little", signed=True)

    return tree_digest(layout.tree, tensors, content)


def _word_sum(t: torch.Tensor) -> int:
    """The tensor's bytes summed as 64-bit words (wrapping), its last partial word byte by
    byte: a flipped bit changes it by a power of two, never by a multiple of 2**64."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    head = raw[:whole]
    if head.storage_offset() % 8:
        head = head.clone()  # a word view needs 8-byte alignment (a tensor's start mostly is)
    total = int(head.view(torch.int64).sum()) if whole else 0
    return total + int(raw[whole:].sum(dtype=torch.int64))


@dataclass(frozen=True)
class Verdict:
    """The group's digests compared: the ranks that differ from their key's strict majority,
    the keys with no strict majority (two replicas that differ), the keys compared."""
    diverged: tuple[int, ...]
    undecided: tuple[int, ...]
    keys_compared: int

    @property
    def agreed(self) -> bool:
        return not self.diverged and not self.undecided


def compare(digests: Sequence[bytes], key: Callable[[int], int]) -> Verdict:
    """Pure: rank r's digest is digests[r]; ranks of one key (`key(r)`) must agree."""
    by_key: dict[int, list[int]] = {}
    for r in range(len(digests)):
        by_key.setdefault(key(r), []).append(r)
    diverged: list[int] = []
    undecided: list[int] = []
    compared = 0
    for k, ranks in sorted(by_key.items()):
        if len(ranks) < 2:
            continue  # one holder: nothing to compare with (1-D FSDP)
        compared += 1
        counts = Counter(digests[r] for r in ranks)
        top, n = counts.most_common(1)[0]
        if n == len(ranks):
            continue
        if 2 * n > len(ranks):
            diverged += [r for r in ranks if digests[r] != top]
        else:
            undecided.append(k)
    return Verdict(tuple(diverged), tuple(undecided), compared)


# A disagreement is rolled back so many times in a row: a flip (a transient fault) is gone after
# one recompute, so a second disagreement right after it says the replicas compute differently
# or a node keeps computing wrong, which more rollbacks would only repeat.
MAX_ROLLBACKS = 1


@dataclass(frozen=True)
class History:
    """What the comparisons of this run said so far, as each rank carries it beside its digest:
    whether the replicas ever agreed, the rollbacks since the last agreement, and whether the
    check is off. A rank that joined later knows none of it; `merge` keeps what any rank
    knows."""
    agreed_once: bool = False
    rollbacks: int = 0
    off: bool = False

    SIZE = 2  # bytes on the wire

    def encode(self) -> bytes:
        return bytes([self.agreed_once | self.off << 1, min(self.rollbacks, 255)])

    @staticmethod
    def decode(raw: bytes) -> "History":
        return History(bool(raw[0] & 1), raw[1], bool(raw[0] & 2))

    @staticmethod
    def merge(histories: Sequence["History"]) -> "History":
        return History(any(h.agreed_once for h in histories),
                       max((h.rollbacks for h in histories), default=0),
                       any(h.off for h in histories))


class Action(str, Enum):
    """What the group does about one comparison (`replica.diverged`'s `action`)."""
    AGREED = "agreed"
    ROLLBACK = "rollback"
    OFF = "off"          # the check turns itself off now
    IGNORED = "ignored"  # it is off already

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Judgement:
    """The group's answer to one comparison: what it does, the ranks whose nodes are moved
    out (`blamed`), why the check turns off (`why`, for OFF), and the group's history after
    it."""
    action: Action
    blamed: tuple[int, ...]
    why: str
    history: History


def judge(verdict: Verdict, history: History) -> Judgement:
    """Pure: the group's answer to `verdict`, given what the comparisons before it said."""
    if history.off:
        return Judgement(Action.IGNORED, (), "", history)
    if verdict.agreed:
        return Judgement(Action.AGREED, (), "", History(agreed_once=True))
    # Before any agreement a differing replica may be a healthy node that computes otherwise.
    blamed = verdict.diverged if history.agreed_once else ()
    if history.rollbacks < MAX_ROLLBACKS:
        return Judgement(Action.ROLLBACK, blamed, "",
                         replace(history, rollbacks=history.rollbacks + 1))
    if history.agreed_once:
        why = ("the replicas disagree again after a rollback's recompute: the ranks outside "
               "their key's majority keep computing other bits (a faulty node, or a "
               "nondeterministic op)")
    else:
        why = ("the replicas have differed since their first comparison, and again after a "
               "rollback's recompute: they compute other bits (CPU kernels dispatched at "
               "another level, ATEN_CPU_CAPABILITY, or a nondeterministic op), not a flip")
    return Judgement(Action.OFF, blamed, why, replace(history, off=True))


def exchange(mine: bytes, world_size: int) -> list[bytes]:
    """Every rank's digest, by one all-gather over this generation's group (on the GPU for
    NCCL, which moves device tensors only)."""
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t)
    return [bytes(o.cpu().numpy()) for o in out]
