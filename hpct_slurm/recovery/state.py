"""Everything a rank needs to continue bit-identically, as one flat byte buffer + a JSON layout.

A snapshot is the registered objects' state dicts, the RNG states and user extras. Tensors are
copied into one preallocated byte buffer at 64-byte aligned offsets; everything else (the
structure, hyper-parameters, Python/numpy RNG ints) goes into a small JSON tree in the layout.
One flat buffer makes a transfer a single send/recv_into and its digest one tree of hashes (the
protocol's `part_digest`, see slots.py for when it is computed).

`TrainState` is the registry (what is registered, in which scope), the capture of a snapshot
and its restore, with the proof of what was restored. The encoding is encoding.py's, the
copies into the buffer copies.py's, what a restore puts into the live objects loading.py's.
"""
from __future__ import annotations

import random
from typing import Any, Iterable, Literal

import numpy as np
import torch

from ..errors import HpctError, UsageError
from .copies import as_flat_u8, copy_pairs
from .encoding import (EXTRAS_KEY, RNG_KEY, Layout, TensorEntry, aligned, decode, encode, is_dtensor,
                       top_level)
from .layout_rules import placement, wrong_coordinates
from .loading import check_shards, cloned, kept
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


def same_model(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are one model: the same module, or one is torch.compile's wrapper
    of the other (an OptimizedModule keeps the module it compiles as `_orig_mod`, with the
    very same parameters and buffers). Scripts register either and wrap either in DDP."""
    return a is b or (a is not None and b is not None and (
        getattr(a, "_orig_mod", None) is b or getattr(b, "_orig_mod", None) is a))


def local_ptr(t: torch.Tensor) -> int:
    """The address of a tensor's data: a DTensor's local shard's."""
    return (t.to_local() if is_dtensor(t) else t).data_ptr()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (Adam's moments and step counts)."""
    return [t for st in optimizer.state.values() for t in st.values()
            if isinstance(t, torch.Tensor)]


def describe_coord(names: Iterable[str], coord: Iterable[int]) -> str:
    return "(" + ", ".join(f"{n}={c}" for n, c in zip(names, coord)) + ")"


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
                check_shards(name, obj, pending[0])
                copying: set[torch.device] = set()
                obj.load_state_dict(kept(obj, pending[0], copying))
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
        found: dict[str, Any] = {name: obj.state_dict() for name, (obj, sc) in self._objects.items()
                                 if sc in scopes}
        # State restored for a name not registered yet belongs to the step as much as the
        # rest: a snapshot taken before its object registers keeps it as it came.
        for name, (sd, restored) in self._pending.items():
            if restored & scopes:
                found[name] = sd
        # In name order: the order of registration differs between ranks that hold the same
        # state (a spare's Job registers the loop's position after the positional objects, a
        # survivor kept it registered from its last run of main()), and a tree in that order
        # made the replicas' digests differ (crosscheck.py) where nothing else did.
        tree = {name: found[name] for name in sorted(found)}
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
        tree = encode(self._gather(scopes, rng), tensors, "state")
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
                off = aligned(off + nbytes)
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
            place = [placement(c, path) for c in meta["place"]]
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
        wrong = wrong_coordinates(names, coord, here, self.replicate)
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
        tensors: list[Any] = [v.clone().numpy() if e.numpy else v  # views; see kept
                              for v, e in zip(views, layout.entries)]
        tree = decode(layout.tree, tensors, self._dtensor)
        raw = top_level(layout.tree)
        scopes = set(scopes)
        copying: set[torch.device] = set()
        try:
            for name, sd in tree.items():
                if name in (RNG_KEY, EXTRAS_KEY):
                    continue
                if name not in self._objects:
                    # Registered later (the inline form, after Job(...)): kept for `register`,
                    # and the proof says so if nothing ever registers it.
                    self._pending[name] = (cloned(sd), frozenset(scopes))
                elif self._objects[name][1] in scopes:
                    obj = self._objects[name][0]
                    check_shards(name, obj, sd)
                    obj.load_state_dict(kept(obj, sd, copying))
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
            rng = cloned(tree[RNG_KEY])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        if EXTRAS_KEY in tree:
            self.extras = cloned(tree[EXTRAS_KEY])

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
    node = encode(obj, tensors, "state")
    return tree_digest(node, [t for t, _ in tensors])
