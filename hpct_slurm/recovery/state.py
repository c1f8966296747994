"""Everything a rank needs to continue bit-identically, as one flat byte buffer + a JSON layout.

A snapshot is the registered objects' state dicts, the RNG states and user extras. Tensors are
copied into one preallocated byte buffer at 64-byte aligned offsets; everything else (the
structure, hyper-parameters, Python/numpy RNG ints) goes into a small JSON tree in the layout.
One flat buffer makes a transfer a single send/recv_into and its digest one tree of hashes (the
protocol's `part_digest`, see snapshot.py for when it is computed).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Iterable, Literal

import numpy as np
import torch

from ..errors import HpctError

ALIGN = 64
Scope = Literal["shared", "rank"]
# `shared`: identical on every rank under plain data parallelism (model, optimizer, scheduler),
# so a replacement can take it from any survivor. `rank`: this rank's own (data position, RNG).
DEFAULT_SCOPES: dict[str, Scope] = {"model": "shared", "optimizer": "shared",
                                    "lr_scheduler": "shared", "scheduler": "shared",
                                    "sampler": "rank"}
RNG_KEY = "rng"
EXTRAS_KEY = "extras"


@dataclass(frozen=True)
class TensorEntry:
    dtype: str        # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    numpy: bool       # restored as a numpy array (numpy's RNG state), not a tensor


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a snapshot lives in the flat buffer, plus the non-tensor tree."""
    entries: tuple[TensorEntry, ...]
    tree: dict
    nbytes: int

    def signature(self) -> tuple:
        return tuple((e.dtype, e.shape) for e in self.entries)

    def to_json(self) -> bytes:
        return json.dumps({"nbytes": self.nbytes, "tree": self.tree,
                           "entries": [[e.dtype, list(e.shape), e.offset, e.nbytes, e.numpy]
                                       for e in self.entries]}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Layout":
        try:
            obj = json.loads(raw)
            entries = tuple(TensorEntry(str(d), tuple(int(x) for x in s), int(o), int(n), bool(np_))
                            for d, s, o, n, np_ in obj["entries"])
            layout = cls(entries, obj["tree"], int(obj["nbytes"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise HpctError(f"snapshot layout is malformed: {exc}") from None
        for e in layout.entries:
            if e.offset < 0 or e.offset + e.nbytes > layout.nbytes or not hasattr(torch, e.dtype):
                raise HpctError(f"snapshot layout entry {e} does not fit a {layout.nbytes}-byte buffer")
        return layout


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# --- the JSON tree. Containers are always tagged one-key dicts, scalars are plain JSON, so a
# user dict can never be mistaken for a tag and int/tuple keys survive the round trip.

def _encode(obj: Any, tensors: list, path: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        tensors.append((obj, False))
        return {"T": len(tensors) - 1}
    if isinstance(obj, np.ndarray):
        tensors.append((torch.from_numpy(np.ascontiguousarray(obj)), True))
        return {"T": len(tensors) - 1}
    if isinstance(obj, list):
        return {"l": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, tuple):
        return {"t": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        return {"d": [[_encode(k, tensors, f"{path} key"), _encode(v, tensors, f"{path}.{k}")]
                      for k, v in obj.items()]}
    raise HpctError(f"cannot snapshot {path}: values of type {type(obj).__name__} are not "
                    f"supported (tensors, numpy arrays, JSON scalars, lists, tuples, dicts are)")


def _decode(node: Any, tensors: list) -> Any:
    if not isinstance(node, dict):
        return node
    (tag, value), = node.items()
    if tag == "T":
        return tensors[value]
    if tag == "l":
        return [_decode(v, tensors) for v in value]
    if tag == "t":
        return tuple(_decode(v, tensors) for v in value)
    if tag == "d":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value}
    raise HpctError(f"snapshot layout has an unknown tree tag {tag!r}")


def as_flat_u8(buf: Any) -> torch.Tensor:
    """A uint8 tensor over `buf` (a tensor, numpy array, bytearray or writable memoryview)."""
    if isinstance(buf, torch.Tensor):
        return buf.view(torch.uint8).reshape(-1)
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf.reshape(-1).view(np.uint8))
    mv = memoryview(buf).cast("B")
    if len(mv) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(np.frombuffer(mv, dtype=np.uint8))


def as_memoryview(buf: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a flat CPU uint8 tensor (for sockets and digests)."""
    return memoryview(buf.numpy()).cast("B")


class TrainState:
    """The registered training state of one rank.

    `register(model=..., optimizer=..., lr_scheduler=..., sampler=...)` takes anything with
    `state_dict`/`load_state_dict`; `extras` holds small user values (JSON scalars, lists,
    dicts, tensors). Python, numpy, torch CPU and (when present) CUDA RNG states are always part
    of the `rank` scope.
    """

    def __init__(self, **objects: Any):
        self._objects: dict[str, tuple[Any, Scope]] = {}
        self.extras: dict[str, Any] = {}
        # Destination views per buffer (two slots alternate), rebuilt only when the layout changes.
        self._dst_cache: dict[int, tuple[tuple, list[torch.Tensor]]] = {}
        self.register(**objects)

    def register(self, scope: Scope | None = None, **objects: Any) -> None:
        for name, obj in objects.items():
            if name in (RNG_KEY, EXTRAS_KEY):
                raise HpctError(f"TrainState: the name {name!r} is reserved; register under another name")
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise HpctError(f"TrainState: {name!r} ({type(obj).__name__}) has no "
                                f"state_dict/load_state_dict")
            self._objects[name] = (obj, scope or DEFAULT_SCOPES.get(name, "rank"))

    def has_rank_state(self) -> bool:
        """Whether anything of this rank's own (a sampler position, extras) is registered
        beyond the RNG states, which `Job` reseeds from (seed, rank, step) every step."""
        return bool(self.extras) or any(sc == "rank" for _, sc in self._objects.values())

    def get(self, name: str) -> Any:
        return self._objects[name][0] if name in self._objects else None

    # --- capture ---------------------------------------------------------------------------

    def _gather(self, scopes: Iterable[Scope]) -> dict:
        scopes = set(scopes)
        tree: dict[str, Any] = {name: obj.state_dict() for name, (obj, sc) in self._objects.items()
                                if sc in scopes}
        if "rank" in scopes:
            rng: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                                   "torch": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rng["cuda"] = torch.cuda.get_rng_state_all()
            tree[RNG_KEY] = rng
            tree[EXTRAS_KEY] = self.extras
        return tree

    def plan(self, scopes: Iterable[Scope] = ("shared", "rank")) -> tuple[Layout, list[torch.Tensor]]:
        """The layout of a snapshot taken now, and the live tensors it would copy."""
        tensors: list[tuple[torch.Tensor, bool]] = []
        tree = _encode(self._gather(scopes), tensors, "state")
        entries, off = [], 0
        for t, is_np in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(TensorEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape), off,
                                       nbytes, is_np))
            off = _align(off + nbytes)
        return Layout(tuple(entries), tree, off), [t for t, _ in tensors]

    def capture_into(self, buf: torch.Tensor | None,
                     scopes: Iterable[Scope] = ("shared", "rank")) -> tuple[Layout, torch.Tensor]:
        """Copy a snapshot into `buf` (flat uint8 CPU tensor), reallocating only if it is too small.

        Call between steps. Returns the layout and the buffer actually used; in steady state that
        is `buf` itself and nothing but the small JSON tree is allocated. The optimizer state
        appears after the first step, so the first capture after it grows the buffer once.
        """
        layout, live = self.plan(scopes)
        if buf is None or buf.numel() < layout.nbytes:
            on_cuda = any(t.is_cuda for t in live)
            buf = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        sig = layout.signature()
        cached = self._dst_cache.get(buf.data_ptr())
        if cached is None or cached[0] != sig:
            if len(self._dst_cache) >= 4:
                self._dst_cache.clear()
            dsts = [buf[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
                    for e in layout.entries]
            cached = self._dst_cache[buf.data_ptr()] = (sig, dsts)
        non_blocking = buf.is_pinned()
        for dst, src in zip(cached[1], live):
            dst.copy_(src.detach(), non_blocking=non_blocking and src.is_cuda)
        if non_blocking and torch.cuda.is_available():
            torch.cuda.synchronize()
        return layout, buf

    # --- restore ---------------------------------------------------------------------------

    def restore_from(self, layout: Layout, buf: Any,
                     scopes: Iterable[Scope] = ("shared", "rank")) -> None:
        """Load a snapshot back: every registered object found in it, the RNG states, extras —
        only those of `scopes` (another rank's snapshot gives its `shared` scope only).

        Tensors are cloned out of `buf`, so the buffer can be reused right away (optimizers keep
        the tensors they are given).
        """
        flat = as_flat_u8(buf)
        if flat.numel() < layout.nbytes:
            raise HpctError(f"snapshot buffer holds {flat.numel()} bytes, its layout needs {layout.nbytes}")
        tensors: list[Any] = []
        for e in layout.entries:
            t = flat[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape).clone()
            tensors.append(t.numpy() if e.numpy else t)
        tree = _decode(layout.tree, tensors)
        unknown = set(tree) - set(self._objects) - {RNG_KEY, EXTRAS_KEY}
        if unknown:
            raise HpctError(f"snapshot holds state for {sorted(unknown)} which this TrainState "
                            f"does not register (registered: {sorted(self._objects)})")
        scopes = set(scopes)
        for name, sd in tree.items():
            if name in self._objects and self._objects[name][1] in scopes:
                self._objects[name][0].load_state_dict(sd)
        if "rank" not in scopes:
            return
        if RNG_KEY in tree:
            rng = tree[RNG_KEY]
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        if EXTRAS_KEY in tree:
            self.extras = tree[EXTRAS_KEY]
