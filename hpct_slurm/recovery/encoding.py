"""A snapshot's encoding: its `Layout`, checked field by field where it is read.

The registered objects' state dicts, the RNG states and the extras become one flat byte buffer
and a small JSON tree. Each tensor's bytes lie in the buffer at a 64-byte aligned offset
(`TensorEntry`); everything else (the structure, hyper-parameters, Python/numpy RNG ints) is
the tree, whose containers are tagged so that a user's dict never reads as a tag and int and
tuple keys survive. A sharded tensor (DTensor) is its local shard plus what places it on the
mesh (layout_rules.py says which placements). A layout comes from a peer or from disk, so
decoding it refuses, naming the field, anything that is not a layout this code wrote.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import HpctError
from .layout_rules import placement_code

ALIGN = 64


RNG_KEY = "rng"
EXTRAS_KEY = "extras"


@dataclass(frozen=True)
class TensorEntry:
    dtype: str        # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    numpy: bool       # restored as a numpy array (numpy's RNG state), not a tensor


# json.dumps(..., separators=...) builds an encoder per call; a layout is encoded several times
# a step (a rank's own snapshot, its carried slot), so one encoder serves them all (the same
# output as json.dumps with these separators)
_COMPACT = json.JSONEncoder(separators=(",", ":"))


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a snapshot lives in the flat buffer, plus the non-tensor tree."""
    entries: tuple[TensorEntry, ...]
    tree: dict
    nbytes: int

    def to_json(self) -> bytes:
        return _COMPACT.encode({"nbytes": self.nbytes, "tree": self.tree,
                                "entries": [[e.dtype, list(e.shape), e.offset, e.nbytes, e.numpy]
                                            for e in self.entries]}).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Layout":
        """The layout `to_json` wrote, checked field by field: it comes from the network and
        from disk, and everything a restore does with it (offsets, views by dtype and shape)
        must be sound before it is used. A field that is not raises HpctError naming it (a
        JSON `Infinity` used to get through as OverflowError, out of every caller's handling
        of a bad copy; a dtype was any attribute of torch, "load" among them)."""
        try:
            obj = json.loads(raw)
        except (ValueError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
            raise HpctError(f"snapshot layout is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise HpctError(f"snapshot layout is {_shown(obj)}, not an object")
        nbytes = _count(obj.get("nbytes"), "nbytes")
        tree = obj.get("tree")
        if not isinstance(tree, dict):
            raise HpctError(f"snapshot layout's tree is {_shown(tree)}, not an object")
        raw_entries = obj.get("entries")
        if not isinstance(raw_entries, list):
            raise HpctError(f"snapshot layout's entries are {_shown(raw_entries)}, not a list")
        return cls(tuple(_entry(e, f"entries[{i}]", nbytes) for i, e in enumerate(raw_entries)),
                   tree, nbytes)


# The dtypes a snapshot's tensor may have, by name: a layout names one, and looking the name up
# as any attribute of torch took "load" (torch.load) too. `numpy`: those an entry restored as
# a numpy array may have (numpy has no bfloat16, float8 or complex32).
_NUMPY_DTYPES = frozenset(("float64", "float32", "float16", "complex128", "complex64", "int64",
                           "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8",
                           "bool"))
_DTYPES: dict[str, torch.dtype] = {
    name: dt for name in (*_NUMPY_DTYPES, "bfloat16", "complex32", "float8_e4m3fn",
                          "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                          "float8_e8m0fnu")
    if isinstance(dt := getattr(torch, name, None), torch.dtype)}  # (an older torch lacks some)
# Offsets and sizes index int64 tensors
_MAX_COUNT = (1 << 63) - 1


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(value: Any, field: str) -> int:
    """`value` if it is a JSON integer from 0 to int64's largest; a float (1.0, Infinity,
    NaN), a bool or a string is not one."""
    if type(value) is not int or not 0 <= value <= _MAX_COUNT:
        raise HpctError(f"snapshot layout's {field} is {_shown(value)}, not an integer from 0 "
                        f"to 2**63-1")
    return value


def _entry(raw: Any, field: str, total: int) -> TensorEntry:
    """One tensor's entry, [dtype, shape, offset, nbytes, numpy], whole and inside a buffer
    of `total` bytes: its bytes are exactly its shape's, at an offset its dtype can be viewed
    at."""
    if not isinstance(raw, list) or len(raw) != 5:
        raise HpctError(f"snapshot layout's {field} is {_shown(raw)}, not [dtype, shape, "
                        f"offset, nbytes, numpy]")
    dtype, shape, offset, nbytes, is_np = raw
    if type(dtype) is not str or dtype not in _DTYPES:
        raise HpctError(f"snapshot layout's {field}.dtype is {_shown(dtype)}, not one of the "
                        f"tensor dtypes a snapshot holds")
    if not isinstance(shape, list):
        raise HpctError(f"snapshot layout's {field}.shape is {_shown(shape)}, not a list")
    dims = tuple(_count(d, f"{field}.shape[{i}]") for i, d in enumerate(shape))
    offset = _count(offset, f"{field}.offset")
    nbytes = _count(nbytes, f"{field}.nbytes")
    if type(is_np) is not bool:
        raise HpctError(f"snapshot layout's {field}.numpy is {_shown(is_np)}, not true or false")
    if is_np and dtype not in _NUMPY_DTYPES:
        raise HpctError(f"snapshot layout's {field} is a numpy array of dtype {dtype}, which "
                        f"numpy does not have")
    size = _DTYPES[dtype].itemsize
    numel = 1
    for d in dims:
        numel *= d
    if numel * size != nbytes:
        raise HpctError(f"snapshot layout's {field}.nbytes is {nbytes}, but shape {list(dims)} "
                        f"of {dtype} is {numel * size} bytes")
    if offset % size or offset + nbytes > total:
        raise HpctError(f"snapshot layout's {field}.offset {offset} (+{nbytes} bytes) is not a "
                        f"{dtype} position inside the {total}-byte buffer")
    return TensorEntry(dtype, dims, offset, nbytes, is_np)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# --- the JSON tree. Containers are always tagged one-key dicts, scalars are plain JSON, so a
# user dict can never be mistaken for a tag and int/tuple keys survive the round trip.

# Leaves returned as they are, by exact type: tested inline by the containers below, so the
# commonest leaves (a state dict's keys, a parameter group's numbers, its list of parameter
# indices) cost no call and no path
_PLAIN = frozenset((str, int, float, bool, type(None)))


def encode(obj: Any, tensors: list, path: Any) -> Any:
    """The JSON tree of `obj`, its tensors appended to `tensors`. `path` names where `obj`
    sits, for an error only: a chain of (parent, suffix) pairs (`_path`), built as tuples
    because a plan walks every node of the state dicts before every lazily held step, and
    formatting a string per node was most of that walk's cost (docs/benchmarks.md)."""
    if isinstance(obj, torch.Tensor):  # the commonest leaf, tested first
        if is_dtensor(obj):
            # A shard of a sharded tensor (FSDP2, HSDP, TP): its local piece is copied like
            # any tensor; where it sits on the mesh goes with it, so a restore can refuse a
            # shard meant for another coordinate.
            tensors.append((obj.to_local(), False))
            return {"D": [len(tensors) - 1, _dtensor_meta(obj, _path(path))]}
        tensors.append((obj, False))
        return {"T": len(tensors) - 1}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):  # the commonest node (a state dict, a parameter's state)
        return {"d": [[k if k.__class__ in _PLAIN else encode(k, tensors, (path, " key")),
                       v if v.__class__ in _PLAIN else encode(v, tensors, (path, ".", k))]
                      for k, v in obj.items()]}
    if isinstance(obj, np.ndarray):
        tensors.append((torch.from_numpy(np.ascontiguousarray(obj)), True))
        return {"T": len(tensors) - 1}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "t":
                [v if v.__class__ in _PLAIN else encode(v, tensors, (path, "[", i, "]"))
                 for i, v in enumerate(obj)]}
    raise HpctError(f"cannot snapshot {_path(path)}: values of type {type(obj).__name__} are "
                    f"not supported (tensors, numpy arrays, JSON scalars, lists, tuples, dicts "
                    f"are)")


def _path(chain: Any) -> str:
    """The dotted name of a node from `encode`'s chain: ("state", ".", "model") ->
    "state.model"."""
    parts: list[str] = []
    while isinstance(chain, tuple):
        parts.extend(str(p) for p in reversed(chain[1:]))
        chain = chain[0]
    parts.append(str(chain))
    return "".join(reversed(parts))


def decode(node: Any, tensors: list, dtensor: Any = None, path: str = "state") -> Any:
    if not isinstance(node, dict):
        return node
    (tag, value), = node.items()
    if tag == "T":
        return tensors[value]
    if tag == "D":
        if dtensor is None:
            raise HpctError(f"snapshot holds a sharded tensor at {path} but this process has "
                            f"no device mesh to place it on")
        idx, meta = value
        return dtensor(tensors[idx], meta, path)
    if tag == "l":
        return [decode(v, tensors, dtensor, f"{path}[{i}]") for i, v in enumerate(value)]
    if tag == "t":
        return tuple(decode(v, tensors, dtensor, f"{path}[{i}]") for i, v in enumerate(value))
    if tag == "d":
        out = {}
        for k, v in value:
            key = decode(k, tensors, dtensor, path)
            out[key] = decode(v, tensors, dtensor, f"{path}.{key}")
        return out
    raise HpctError(f"snapshot layout has an unknown tree tag {tag!r}")


# --- sharded tensors (DTensor) ------------------------------------------------------------------

def is_dtensor(obj: Any) -> bool:
    return type(obj).__name__ == "DTensor" and hasattr(obj, "device_mesh")


def _dtensor_meta(t: Any, path: str) -> dict:
    mesh = t.device_mesh
    if mesh.mesh_dim_names is None:
        raise HpctError(f"cannot snapshot {path}: its device mesh has no dimension names "
                        f"(init_device_mesh(..., mesh_dim_names=...))")
    return {"mesh": list(mesh.mesh_dim_names),
            "place": [placement_code(p, path) for p in t.placements],
            "shape": list(t.shape), "stride": list(t.stride()),
            "coord": list(mesh.get_coordinate() or [])}


def top_level(tree: Any) -> dict[str, Any]:
    """A snapshot's encoded tree by top-level name (each registered object's subtree)."""
    if not (isinstance(tree, dict) and isinstance(tree.get("d"), list)):
        raise HpctError("snapshot layout's tree is not a mapping of registered names")
    try:
        return {k: v for k, v in tree["d"] if isinstance(k, str)}
    except (TypeError, ValueError):
        raise HpctError("snapshot layout's tree is not a mapping of registered names") from None
