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

from ..errors import HpctError, UsageError
from .proof import tree_digest

ALIGN = 64
Scope = Literal["shared", "rank"]
# `shared`: identical on every rank under plain data parallelism (model, optimizer, scheduler),
# so a replacement can take it from any survivor. `rank`: this rank's own (data position, RNG).
DEFAULT_SCOPES: dict[str, Scope] = {"model": "shared", "optimizer": "shared",
                                    "lr_scheduler": "shared", "scheduler": "shared",
                                    "sampler": "rank"}


def default_scope(name: str, obj: Any) -> Scope:
    """The scope of an object registered without one: by its name where it is a known one,
    else `shared` for models, optimizers and LR schedulers (what data parallelism keeps equal
    on every rank: a GAN's second model, an EMA, their optimizers), `rank` for the rest (a
    sampler, a data position). A model of a rank's own would be wrong as `shared`, silently
    restored from another rank: such a script says scope="rank"."""
    if name in DEFAULT_SCOPES:
        return DEFAULT_SCOPES[name]
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer,
                        torch.optim.lr_scheduler.LRScheduler)):
        return "shared"
    return "rank"


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


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# --- the JSON tree. Containers are always tagged one-key dicts, scalars are plain JSON, so a
# user dict can never be mistaken for a tag and int/tuple keys survive the round trip.

# Leaves returned as they are, by exact type: tested inline by the containers below, so the
# commonest leaves (a state dict's keys, a parameter group's numbers, its list of parameter
# indices) cost no call and no path
_PLAIN = frozenset((str, int, float, bool, type(None)))


def _encode(obj: Any, tensors: list, path: Any) -> Any:
    """The JSON tree of `obj`, its tensors appended to `tensors`. `path` names where `obj`
    sits, for an error only: a chain of (parent, suffix) pairs (`_path`), built as tuples
    because a plan walks every node of the state dicts before every lazily held step, and
    formatting a string per node was most of that walk's cost (docs/benchmarks.md)."""
    if isinstance(obj, torch.Tensor):  # the commonest leaf, tested first
        if _is_dtensor(obj):
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
        return {"d": [[k if k.__class__ in _PLAIN else _encode(k, tensors, (path, " key")),
                       v if v.__class__ in _PLAIN else _encode(v, tensors, (path, ".", k))]
                      for k, v in obj.items()]}
    if isinstance(obj, np.ndarray):
        tensors.append((torch.from_numpy(np.ascontiguousarray(obj)), True))
        return {"T": len(tensors) - 1}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "t":
                [v if v.__class__ in _PLAIN else _encode(v, tensors, (path, "[", i, "]"))
                 for i, v in enumerate(obj)]}
    raise HpctError(f"cannot snapshot {_path(path)}: values of type {type(obj).__name__} are "
                    f"not supported (tensors, numpy arrays, JSON scalars, lists, tuples, dicts "
                    f"are)")


def _path(chain: Any) -> str:
    """The dotted name of a node from `_encode`'s chain: ("state", ".", "model") ->
    "state.model"."""
    parts: list[str] = []
    while isinstance(chain, tuple):
        parts.extend(str(p) for p in reversed(chain[1:]))
        chain = chain[0]
    parts.append(str(chain))
    return "".join(reversed(parts))


def _decode(node: Any, tensors: list, dtensor: Any = None, path: str = "state") -> Any:
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
        return [_decode(v, tensors, dtensor, f"{path}[{i}]") for i, v in enumerate(value)]
    if tag == "t":
        return tuple(_decode(v, tensors, dtensor, f"{path}[{i}]") for i, v in enumerate(value))
    if tag == "d":
        out = {}
        for k, v in value:
            key = _decode(k, tensors, dtensor, path)
            out[key] = _decode(v, tensors, dtensor, f"{path}.{key}")
        return out
    raise HpctError(f"snapshot layout has an unknown tree tag {tag!r}")


# --- sharded tensors (DTensor) ------------------------------------------------------------------

def _is_dtensor(obj: Any) -> bool:
    return type(obj).__name__ == "DTensor" and hasattr(obj, "device_mesh")


def _placement_code(p: Any, path: str) -> str:
    """A placement as the snapshot layout writes it: "R", "S<dim>", or "S<dim>/<split>" for
    the strided shard FSDP2 leaves on a tensor-parallel parameter (`fully_shard` over a
    `parallelize_module`d model: each rank holds `split` interleaved row blocks). A restore
    places the local shard back at the same coordinate, so the code needs only to name the
    placement again, not to describe which global rows it holds."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(p, Replicate):
        return "R"
    if type(p) is Shard:
        return f"S{p.dim}"
    if type(p).__name__ == "_StridedShard":
        return f"S{p.dim}/{p.split_factor}"
    raise HpctError(f"cannot snapshot {path}: placement {p!r} is not supported "
                    f"(Replicate, Shard(dim) and FSDP2's strided Shard over tensor "
                    f"parallelism are)")


def _placement(code: str, path: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if code == "R":
        return Replicate()
    if isinstance(code, str) and code[:1] == "S":
        dim, _, split = code[1:].partition("/")
        if _small_int(dim) and not split:
            return Shard(int(dim))
        if _small_int(dim) and _small_int(split) and int(split) >= 1:
            from torch.distributed.tensor.placement_types import _StridedShard
            return _StridedShard(int(dim), split_factor=int(split))
    raise HpctError(f"snapshot layout gives {path} an unknown placement {code!r}")


def _small_int(text: str) -> bool:
    """A placement's number as the layout may give it: ASCII digits, at most 4."""
    return text.isascii() and text.isdigit() and len(text) <= 4


def _dtensor_meta(t: Any, path: str) -> dict:
    mesh = t.device_mesh
    if mesh.mesh_dim_names is None:
        raise HpctError(f"cannot snapshot {path}: its device mesh has no dimension names "
                        f"(init_device_mesh(..., mesh_dim_names=...))")
    return {"mesh": list(mesh.mesh_dim_names),
            "place": [_placement_code(p, path) for p in t.placements],
            "shape": list(t.shape), "stride": list(t.stride()),
            "coord": list(mesh.get_coordinate() or [])}


def local_ptr(t: torch.Tensor) -> int:
    """The address of a tensor's data: a DTensor's local shard's."""
    return (t.to_local() if _is_dtensor(t) else t).data_ptr()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (Adam's moments and step counts)."""
    return [t for st in optimizer.state.values() for t in st.values()
            if isinstance(t, torch.Tensor)]


def describe_coord(names: Iterable[str], coord: Iterable[int]) -> str:
    return "(" + ", ".join(f"{n}={c}" for n, c in zip(names, coord)) + ")"


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


# One copy stream per GPU for snapshot copies: they run beside the training's kernels instead of
# in line with them on its stream (measured on an H200 with 2.6 GB of state and a 77 ms step:
# +63 % per step in line with a device-wide synchronize, +4.4 % on a side stream).
_copy_streams: dict[torch.device, Any] = {}
# (device, CUDA event) pairs: what a snapshot copy on a GPU is done at
Marks = list[tuple[torch.device, Any]]


def _copy_stream(device: torch.device) -> Any:
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device=device)
    return stream


def mark_ready(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Marks:
    """An event on the current stream of every GPU a live tensor of `pairs` is on, recorded
    now: called by the thread that ran the step, right after it, it marks the step's last
    write to them. Copies ordered after it read the step's state, and nothing later."""
    marks: Marks = []
    if not torch.cuda.is_initialized():  # no tensor can be on a GPU: no walk over them
        return marks
    for device in {src.device for _, src in pairs if src.is_cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        marks.append((device, event))
    return marks


def issue_copies(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 ready: Marks | None = None) -> Marks:
    """Start the copy of each live tensor into its destination without waiting for the GPU:
    a CUDA tensor into pinned host memory goes on its device's copy stream, after `ready`
    (default: after everything queued on the current stream now); anything else is copied at
    once (a CPU tensor, or a CUDA one into pageable memory, which CUDA copies synchronously).
    Returns the events the GPU copies are done at: wait on them (`wait_marks`) before the
    destination is read, and order any write to the sources after them (`order_after`)."""
    after = dict(ready or ())
    streams: dict[torch.device, Any] = {}
    for dst, src in pairs:
        src = src.detach()
        if not (src.is_cuda and dst.is_pinned()):
            dst.copy_(src)
            continue
        stream = streams.get(src.device)
        if stream is None:
            stream = streams[src.device] = _copy_stream(src.device)
            if src.device in after:
                stream.wait_event(after[src.device])
            else:
                stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
    done: Marks = []
    for device, stream in streams.items():
        event = torch.cuda.Event()
        event.record(stream)
        done.append((device, event))
    return done


def wait_marks(marks: Marks) -> None:
    """Until the copies behind `marks` are done (this thread waits; the GPU does not)."""
    for _, event in marks:
        event.synchronize()


def order_after(marks: Marks) -> None:
    """Make the current streams wait on the GPU, not here, for the copies behind `marks`:
    kernels queued from now on (the next optimizer update) cannot overwrite a source first."""
    for device, event in marks:
        torch.cuda.current_stream(device).wait_event(event)


def copy_pairs(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each live tensor into its destination and wait for it: pinned host memory for
    CUDA tensors, on the copy stream (issue_copies), waited for by its events only, never by
    a device-wide synchronize that would wait for the training's own kernels too."""
    wait_marks(issue_copies(pairs))


def as_memoryview(buf: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a flat CPU uint8 tensor (for sockets and digests)."""
    return memoryview(buf.numpy()).cast("B")


class TrainState:
    """The registered training state of one rank.

    `register(model=..., optimizer=..., lr_scheduler=..., sampler=...)` takes anything with
    `state_dict`/`load_state_dict`; `extras` holds small user values (JSON scalars, lists,
    dicts, tensors). Python, numpy, torch CPU and (when present) CUDA RNG states are part of
    the `rank` scope, unless a capture leaves them out (`rng=False`): an owner that reseeds
    every generator before the state is next used (`Job`, from (seed, rank, step) before every
    step) would copy them only to overwrite them. A snapshot without them restores nothing
    into the generators.
    """

    def __init__(self, **objects: Any):
        self._objects: dict[str, tuple[Any, Scope]] = {}
        self.extras: dict[str, Any] = {}
        # Destination views per buffer (two slots alternate), rebuilt only when the layout changes.
        self._dst_cache: dict[int, tuple[tuple, list[torch.Tensor]]] = {}
        # (scopes, rng) -> the tensors' kinds, the entries and size of the last plan (`plan`)
        self._plans: dict[tuple, tuple[list, tuple[TensorEntry, ...], int]] = {}
        # A sharded job's DeviceMesh and its replicated dimension names (set by `Job` for each
        # generation): where restored shards are placed, and which coordinates must match.
        self.mesh: Any = None
        self.replicate: tuple[str, ...] = ()
        # The proof of the last restore (proof.py): each restored name's digest, the scopes
        # restored, and the state restored for names nobody had registered yet (the inline
        # form registers some after `Job(...)` restored): `register` loads it into the object.
        self._restored: dict[str, bytes] = {}
        self._restored_scopes: set[str] = set()
        self._pending: dict[str, tuple[Any, frozenset[str]]] = {}
        self.version = 0  # one more at every change of what is registered
        self.register(**objects)

    def register(self, scope: Scope | None = None, **objects: Any) -> None:
        """Register each object under its name. An object registered after a restore that
        held state for its name gets that state now (the inline form: `main()` runs again
        and registers its new objects after `Job(...)` restored). Registering the same
        object under the same name again does nothing; anything else that would register
        one state twice is refused (`_refuse_twice`)."""
        for name, obj in objects.items():
            if name in (RNG_KEY, EXTRAS_KEY):
                raise UsageError(f"TrainState: the name {name!r} is reserved; register under another name")
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise UsageError(f"TrainState: {name!r} ({type(obj).__name__}) has no "
                                f"state_dict/load_state_dict")
            if name in self._objects and self._objects[name][0] is obj:
                continue
            self._refuse_twice(name, obj)
            sc = scope or default_scope(name, obj)
            if sc not in ("shared", "rank"):
                raise UsageError(f"TrainState: scope {sc!r} of {name!r} is not 'shared' or 'rank'")
            self._objects[name] = (obj, sc)
            self.version += 1
            pending = self._pending.get(name)
            if pending is not None and sc in pending[1]:
                del self._pending[name]
                _check_shards(name, obj, pending[0])
                copying: set[torch.device] = set()
                obj.load_state_dict(_kept(obj, pending[0], copying))
                for device in copying:
                    torch.cuda.current_stream(device).synchronize()

    def _refuse_twice(self, name: str, obj: Any) -> None:
        """A name already taken, an object already registered under another name, a module
        whose parameters a registered one holds too (a DDP around a registered model): each
        would restore one state into two places, or two states into one."""
        if name in self._objects:
            held = type(self._objects[name][0]).__name__
            raise UsageError(f"TrainState: {name!r} is already registered (a {held}); register "
                            f"each object once, under a name of its own. After a fault the "
                            f"inline form's main() registers its new objects in place of the "
                            f"last run's by itself; a loop function (job.run) keeps its "
                            f"objects: register them before job.run, not inside the loop")
        for other, (held, _) in self._objects.items():
            if held is obj:
                raise UsageError(f"TrainState: this {type(obj).__name__} is already registered "
                                f"as {other!r}; register it once")
            if isinstance(obj, torch.nn.Module) and isinstance(held, torch.nn.Module):
                mine = {id(p) for p in obj.parameters()}
                if mine and mine & {id(p) for p in held.parameters()}:
                    raise UsageError(
                        f"TrainState: {name!r} ({type(obj).__name__}) holds parameters of "
                        f"{other!r} ({type(held).__name__}), registered already: register "
                        f"each model once, the module itself and not a wrapper around it "
                        f"(DDP, the drop-in DistributedDataParallel) as well")

    def unregister(self, *names: str) -> None:
        for name in names:
            self._objects.pop(name, None)
        self.version += 1

    def names(self) -> list[str]:
        return list(self._objects)

    def scope(self, name: str) -> Scope:
        return self._objects[name][1]

    def has_rank_state(self) -> bool:
        """Whether anything of this rank's own (a sampler position, extras) is registered
        beyond the RNG states, which `Job` reseeds from (seed, rank, step) every step."""
        return bool(self.extras) or any(sc == "rank" for _, sc in self._objects.values())

    def get(self, name: str) -> Any:
        return self._objects[name][0] if name in self._objects else None

    # --- capture ---------------------------------------------------------------------------

    def _gather(self, scopes: Iterable[Scope], rng: bool = True) -> dict:
        scopes = set(scopes)
        tree: dict[str, Any] = {name: obj.state_dict() for name, (obj, sc) in self._objects.items()
                                if sc in scopes}
        # State restored for a name not registered yet belongs to the step as much as the
        # rest: a snapshot taken before its object registers keeps it as it came.
        for name, (sd, restored) in self._pending.items():
            if restored & scopes:
                tree[name] = sd
        if "rank" in scopes and rng:
            rngs: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                                    "torch": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rngs["cuda"] = torch.cuda.get_rng_state_all()
            tree[RNG_KEY] = rngs
        if "rank" in scopes:
            tree[EXTRAS_KEY] = self.extras
        return tree

    def plan(self, scopes: Iterable[Scope] = ("shared", "rank"), rng: bool = True
             ) -> tuple[Layout, list[torch.Tensor]]:
        """The layout of a snapshot taken now, and the live tensors it would copy (`rng`:
        with the RNG states, where the scopes include `rank`)."""
        tensors: list[tuple[torch.Tensor, bool]] = []
        tree = _encode(self._gather(scopes, rng), tensors, "state")
        # The entries follow from the tensors' kinds and shapes alone, which stay the same
        # from step to step: built again only when they change (a plan runs before every
        # lazily held step; building an entry per tensor was a third of its cost).
        kinds = [(t.dtype, t.shape, is_np) for t, is_np in tensors]
        key = (tuple(scopes), rng)
        cached = self._plans.get(key)
        if cached is not None and cached[0] == kinds:
            entries, off = cached[1], cached[2]
        else:
            built, off = [], 0
            for t, is_np in tensors:
                nbytes = t.numel() * t.element_size()
                built.append(TensorEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                         off, nbytes, is_np))
                off = _align(off + nbytes)
            entries = tuple(built)
            self._plans[key] = (kinds, entries, off)
        return Layout(entries, tree, off), [t for t, _ in tensors]

    def capture_into(self, buf: torch.Tensor | None,
                     scopes: Iterable[Scope] = ("shared", "rank"), rng: bool = True
                     ) -> tuple[Layout, torch.Tensor]:
        """Copy a snapshot into `buf` (flat uint8 CPU tensor), reallocating only if it is too small.

        Call between steps. Returns the layout and the buffer actually used; in steady state that
        is `buf` itself and nothing but the small JSON tree is allocated. The optimizer state
        appears after the first step, so the first capture after it grows the buffer once.
        """
        layout, buf, pairs = self.prepare(buf, scopes, rng)
        copy_pairs(pairs)
        return layout, buf

    def prepare(self, buf: torch.Tensor | None, scopes: Iterable[Scope] = ("shared", "rank"),
                rng: bool = True
                ) -> tuple[Layout, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The layout of a snapshot taken now, the buffer it goes to (`buf`, grown if too
        small) and the (destination, live tensor) pairs still to copy: everything but the
        bytes is fixed at this moment (the JSON tree holds the RNG states and scalars)."""
        layout, live = self.plan(scopes, rng)
        if buf is None or buf.numel() < layout.nbytes:
            on_cuda = any(t.is_cuda for t in live)
            buf = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        cached = self._dst_cache.get(buf.data_ptr())
        # the same entries object as a plan's last (the common case) or equal ones
        if cached is None or (cached[0] is not layout.entries
                              and cached[0] != layout.entries):
            if len(self._dst_cache) >= 4:
                self._dst_cache.clear()
            dsts = [buf[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
                    for e in layout.entries]
            cached = self._dst_cache[buf.data_ptr()] = (layout.entries, dsts)
        return layout, buf, list(zip(cached[1], live))

    def stable_ptrs(self) -> set[int]:
        """Addresses of the tensors only an optimizer step changes: the parameters of every
        registered module and the state of every registered optimizer. A snapshot may copy
        them after the step function returned, until the next optimizer step."""
        ptrs: set[int] = set()
        for obj, _ in self._objects.values():
            if isinstance(obj, torch.nn.Module):
                ptrs.update(local_ptr(p) for p in obj.parameters())
            elif isinstance(obj, torch.optim.Optimizer):
                ptrs.update(local_ptr(t) for t in optimizer_state_tensors(obj))
        return ptrs

    # --- restore ---------------------------------------------------------------------------

    def _dtensor(self, local: torch.Tensor, meta: Any, path: str) -> Any:
        """A shard from a snapshot placed on this process's mesh, refused when it was taken at
        another coordinate of the sharded dimensions (it belongs to other parameters' rows)."""
        from torch.distributed.tensor import DTensor

        if self.mesh is None:
            raise HpctError(f"snapshot holds a sharded tensor at {path} but this process has "
                            f"no device mesh to place it on")
        try:
            names = tuple(str(n) for n in meta["mesh"])
            place = [_placement(c, path) for c in meta["place"]]
            shape, stride = torch.Size(int(x) for x in meta["shape"]), tuple(
                int(x) for x in meta["stride"])
            coord = [int(c) for c in meta["coord"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise HpctError(f"snapshot layout describes {path} badly: {exc}") from None
        root = self.mesh
        try:
            mesh = root if names == tuple(root.mesh_dim_names or ()) else root[names]
        except (KeyError, RuntimeError, ValueError) as exc:
            raise HpctError(f"snapshot places {path} on mesh dimensions {list(names)}, which "
                            f"this job's mesh {list(root.mesh_dim_names or ())} lacks: "
                            f"{exc}") from None
        here = list(mesh.get_coordinate() or [])
        if len(place) != len(names) or len(coord) != len(names):
            raise HpctError(f"snapshot layout of {path}: {len(place)} placements and "
                            f"{len(coord)} coordinates for {len(names)} mesh dimensions")
        wrong = [n for n, a, b in zip(names, coord, here) if n not in self.replicate and a != b]
        if wrong:
            raise HpctError(f"refused a shard from the wrong coordinate: {path} was taken at "
                            f"{describe_coord(names, coord)}, this rank is at "
                            f"{describe_coord(names, here)} (replicated: "
                            f"{list(self.replicate) or 'none'})")
        return DTensor.from_local(local, mesh, place, run_check=False, shape=shape,
                                  stride=stride)

    def restore_from(self, layout: Layout, buf: Any,
                     scopes: Iterable[Scope] = ("shared", "rank"), proof: bool = True) -> None:
        """Load a snapshot back: every registered object found in it, the RNG states, extras —
        only those of `scopes` (another rank's snapshot gives its `shared` scope only). Each
        name's restored state is recorded for `prove` (`proof=False` only for a benchmark
        that measures what that costs); state for a name not registered yet waits for it.

        Nothing keeps a reference into `buf`, so it can be reused right away, and nothing is
        allocated that need not be: a module copies the values into its own parameters and
        buffers, an optimizer's state goes into the tensors it already holds (a survivor's:
        fresh memory costs page faults, measured at 10-25x a copy into warm memory for
        100 MB), and only what an object would keep as given (a spare's first optimizer
        state, a scheduler's or the extras' tensors) is cloned out of `buf`.
        """
        flat = as_flat_u8(buf)
        if flat.numel() < layout.nbytes:
            raise HpctError(f"snapshot buffer holds {flat.numel()} bytes, its layout needs {layout.nbytes}")
        views: list[torch.Tensor] = []
        for e in layout.entries:
            views.append(flat[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype))
                         .view(e.shape))
        tensors: list[Any] = [v.clone().numpy() if e.numpy else v  # views; see _kept
                              for v, e in zip(views, layout.entries)]
        tree = _decode(layout.tree, tensors, self._dtensor)
        raw = _top_level(layout.tree)
        scopes = set(scopes)
        copying: set[torch.device] = set()
        try:
            for name, sd in tree.items():
                if name in (RNG_KEY, EXTRAS_KEY):
                    continue
                if name not in self._objects:
                    # Registered later (the inline form, after Job(...)): kept for `register`,
                    # and the proof says so if nothing ever registers it.
                    self._pending[name] = (_cloned(sd), frozenset(scopes))
                elif self._objects[name][1] in scopes:
                    obj = self._objects[name][0]
                    _check_shards(name, obj, sd)
                    obj.load_state_dict(_kept(obj, sd, copying))
                else:
                    continue
                if proof:
                    self._restored[name] = tree_digest(raw[name], views)
        finally:
            for device in copying:  # then nothing reads `buf` any more: the caller may reuse it
                torch.cuda.current_stream(device).synchronize()
        if proof:
            self._restored_scopes |= scopes
        if "rank" not in scopes:
            return
        if EXTRAS_KEY in raw and proof:
            self._restored[EXTRAS_KEY] = tree_digest(raw[EXTRAS_KEY], views)
        if RNG_KEY in tree:
            rng = _cloned(tree[RNG_KEY])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        if EXTRAS_KEY in tree:
            self.extras = _cloned(tree[EXTRAS_KEY])

    def forget_restored(self) -> None:
        """A new restore begins: what the last one recorded for its proof goes."""
        self._restored.clear()
        self._restored_scopes.clear()
        self._pending.clear()

    def prove(self) -> list[str]:
        """What differs between the state restored since `forget_restored` and the objects
        registered now (proof.py): one line per name, none when every object holds exactly
        what was restored. The record is then used up."""
        problems = [f"{name}: restored, but no object was registered under this name since "
                    f"the restore" for name in self._pending]
        for name, (obj, sc) in self._objects.items():
            if sc not in self._restored_scopes:
                continue
            want = self._restored.get(name)
            if want is None:
                problems.append(f"{name}: registered, but the restored snapshot held no state "
                                f"for it")
            elif _live_digest(obj.state_dict()) != want:
                problems.append(f"{name}: the registered {type(obj).__name__} does not hold "
                                f"the state restored into {name!r}")
        if EXTRAS_KEY in self._restored and _live_digest(self.extras) != self._restored[EXTRAS_KEY]:
            problems.append("extras: state.extras changed after the restore")
        self.forget_restored()
        return problems


def _live_digest(obj: Any) -> bytes:
    tensors: list[tuple[torch.Tensor, bool]] = []
    node = _encode(obj, tensors, "state")
    return tree_digest(node, [t for t, _ in tensors])


def _top_level(tree: Any) -> dict[str, Any]:
    """A snapshot's encoded tree by top-level name (each registered object's subtree)."""
    if not (isinstance(tree, dict) and isinstance(tree.get("d"), list)):
        raise HpctError("snapshot layout's tree is not a mapping of registered names")
    try:
        return {k: v for k, v in tree["d"] if isinstance(k, str)}
    except (TypeError, ValueError):
        raise HpctError("snapshot layout's tree is not a mapping of registered names") from None


def _cloned(node: Any) -> Any:
    """`node` with every tensor in it cloned: nothing of it refers to the snapshot buffer."""
    if isinstance(node, torch.Tensor):
        return node.clone()
    if isinstance(node, list):
        return [_cloned(v) for v in node]
    if isinstance(node, tuple):
        return tuple(_cloned(v) for v in node)
    if isinstance(node, dict):
        return {k: _cloned(v) for k, v in node.items()}
    return node


def _has_dtensor(node: Any) -> bool:
    if isinstance(node, (list, tuple)):
        return any(_has_dtensor(v) for v in node)
    if isinstance(node, dict):
        return any(_has_dtensor(v) for v in node.values())
    return _is_dtensor(node)


def _kept(obj: Any, sd: Any, copying: set[torch.device]) -> Any:
    """What `obj.load_state_dict` gets out of a snapshot whose tensors are views into its
    buffer: views where the object copies them (a module), the optimizer's own live tensors
    filled from the views where it holds matching ones (it keeps the tensors it is given),
    clones for everything else. Sharded state (DTensor) is always cloned, as before.

    On a GPU the optimizer's state goes straight from the (pinned) snapshot into device
    memory, without waiting on each tensor: into the survivor's own tensors, or, for a
    newcomer that has none yet, into tensors made on its parameter's device, exactly what
    load_state_dict would have made of a host clone (same dtype: its cast is then a no-op).
    Cloning on the host first and letting load_state_dict move each clone was 10x the raw
    copy (H200: 0.31 s against 0.031 s for 1.7 GB). `copying` collects the devices whose
    copies are still running: restore_from waits for them before `buf` may be reused."""
    if _has_dtensor(sd):
        return _cloned(sd)
    if isinstance(obj, torch.nn.Module):
        return sd  # load_state_dict copies into the module's own tensors
    if not (isinstance(obj, torch.optim.Optimizer) and isinstance(sd, dict)
            and isinstance(sd.get("state"), dict)):
        return _cloned(sd)
    params = [p for g in obj.param_groups for p in g["params"]]
    state: dict = {}
    for idx, st in sd["state"].items():
        param = params[idx] if isinstance(idx, int) and 0 <= idx < len(params) else None
        live = obj.state.get(param) if param is not None else None
        if not isinstance(st, dict):
            state[idx] = _cloned(st)
            continue
        state[idx] = {}
        for k, v in st.items():
            cur = live.get(k) if isinstance(live, dict) else None
            if type(v) is not torch.Tensor:
                state[idx][k] = _cloned(v)
                continue
            if not (type(cur) is torch.Tensor and cur.shape == v.shape
                    and cur.dtype == v.dtype):
                # A newcomer's first state: made where load_state_dict would put it. "step"
                # stays on the host (torch's optimizers keep it there unless capturable).
                if param is not None and param.is_cuda and k != "step" \
                        and v.dtype == param.dtype:
                    cur = torch.empty(v.shape, dtype=v.dtype, device=param.device)
                else:
                    state[idx][k] = _cloned(v)
                    continue
            non_blocking = cur.is_cuda and v.is_pinned()
            with torch.no_grad():
                cur.copy_(v, non_blocking=non_blocking)
            if non_blocking:
                copying.add(cur.device)
            state[idx][k] = cur
    return {**{k: _cloned(v) for k, v in sd.items() if k != "state"}, "state": state}


def _describe_dt(t: Any) -> str:
    return (f"shape {tuple(t.shape)} placed {tuple(t.placements)} local "
            f"{tuple(t.to_local().shape)}")


def _check_shards(name: str, obj: Any, sd: Any) -> None:
    """Refuse restored shards whose global shape, placement or local shape differs from the
    live object's: loading them would fail later with an opaque error, or worse, not at all."""
    if not isinstance(sd, dict):
        return
    pairs: list[tuple[str, Any, Any]] = []
    if isinstance(obj, torch.nn.Module):
        live = obj.state_dict()
        pairs = [(k, v, live.get(k)) for k, v in sd.items() if _is_dtensor(v)]
    elif isinstance(obj, torch.optim.Optimizer) and isinstance(sd.get("state"), dict):
        params = [p for g in obj.param_groups for p in g["params"]]
        for idx, st in sd["state"].items():
            if not isinstance(st, dict) or not isinstance(idx, int) or not 0 <= idx < len(params):
                continue
            p = params[idx]
            pairs += [(f"state[{idx}].{k}", v, p) for k, v in st.items()
                      if _is_dtensor(v) and tuple(v.shape) == tuple(p.shape)]
    for key, got, live in pairs:
        if not _is_dtensor(live):
            raise HpctError(f"refused {name}.{key}: the snapshot holds a shard "
                            f"({_describe_dt(got)}) where this rank holds an unsharded tensor")
        if (tuple(got.shape) != tuple(live.shape) or tuple(got.placements) != tuple(live.placements)
                or tuple(got.to_local().shape) != tuple(live.to_local().shape)):
            raise HpctError(f"refused {name}.{key}: the snapshot's shard has "
                            f"{_describe_dt(got)}, this rank's has {_describe_dt(live)}")
