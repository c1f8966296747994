"""The protocol's messages: one frozen dataclass per message type, and their checked
reconstruction from a header's JSON.

`TYPE` strings and field names are the wire format. JSON has only str keys and lists, so a
received message's fields are coerced back to the annotated types, and anything else is a
`ProtocolError` naming the field rather than a crash later in the controller or a rank.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union

from ..errors import HpctError
from .errors import ProtocolError

# `TYPE` strings are part of the wire format: never rename them.


@dataclass(frozen=True)
class Register:
    TYPE: ClassVar[str] = "register"
    job_id: str
    node: str
    local_rank: int
    role: Literal["active", "spare"]
    pid: int
    host_addr: str
    transfer_port: int


@dataclass(frozen=True)
class Heartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    rank: int
    generation: int
    step: int
    state: str
    # The rank's own time per step (recovery/own_time.py): the median over its last `own_n`
    # steps of this generation, in seconds; -1 / 0: none measured yet. Fail-slow detection
    # compares it between nodes (controller/slowness.py).
    own_s: float = -1.0
    own_n: int = 0


@dataclass(frozen=True)
class Stop:
    TYPE: ClassVar[str] = "stop"
    generation: int
    reason: str
    # The lost nodes' addresses: a rank cuts its own connections to them (gloo has no abort,
    # and a crashed or partitioned peer sends no FIN to end a blocked collective).
    lost_addrs: list[str] = field(default_factory=list)
    # A fault's STOP (not a planned move's): the step in progress can complete nowhere, so
    # every rank leaves it at once and cuts its whole group's connections, lost node or not
    # (a peer that left the collective on its own error keeps its sockets open until its
    # teardown, and a rank blocked reading from it would wait out the collective timeout).
    fault: bool = False


@dataclass(frozen=True)
class Assign:
    TYPE: ClassVar[str] = "assign"
    generation: int
    rank: int
    world_size: int
    members: list[str]
    tasks_per_node: int
    restore_step: int
    # rank -> replica holders of that rank's state, in the order to try them.
    sources: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    # Data-parallel shards this rank computes each step (after an elastic shrink a survivor
    # also computes the lost ranks' shards) and the world they average over; empty/0: its
    # own rank and world_size.
    data_ranks: list[int] = field(default_factory=list)
    data_world: int = 0
    # rank -> its transfer server (host, port) in this generation: where a rank pushes the
    # replica it keeps on its ring neighbour, and where a replacement finds that neighbour.
    peers: dict[int, tuple[str, int]] = field(default_factory=dict)
    # Beyond 512 ranks the controller sends the members as one Slurm hostlist expression
    # instead of `members` (2,000 names cost every Assign 22 KB): read them with member_nodes.
    members_hostlist: str = ""

    def member_nodes(self) -> list[str]:
        """The generation's member nodes, in rank order, however they were sent."""
        return self.members if self.members or not self.members_hostlist else \
            list(_expand_hostlist(self.members_hostlist))


@dataclass(frozen=True)
class Resume:
    TYPE: ClassVar[str] = "resume"
    generation: int
    step: int


@dataclass(frozen=True)
class StepDone:
    TYPE: ClassVar[str] = "step_done"
    rank: int
    generation: int
    step: int


@dataclass(frozen=True)
class Ack:
    TYPE: ClassVar[str] = "ack"
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Goodbye:
    TYPE: ClassVar[str] = "goodbye"
    reason: str


# A rank's Goodbye reason when the script raised an error it would raise again on any node (a
# TypeError, a registration mistake): the job fails as the script's, and no node is fenced.
SCRIPT_ERROR = "the script's own error: "


@dataclass(frozen=True)
class FetchState:
    """Ask a transfer server for `rank`'s snapshot at `step` or later (`slot`: own, replica,
    or rank: the server's own per-rank state, which a rank leaving in a planned move serves).
    `part`: "all" the whole snapshot; "manifest" its layout and the leaf digests sealed with it;
    "range" the `length` data bytes from `offset` (leaf-aligned), for a pull striped over
    several sources (recovery/striped.py); `digest`, the range's digest from the manifest,
    lets a source that has not hashed its copy serve it without hashing (the receiver checks
    every byte against that digest anyway)."""
    TYPE: ClassVar[str] = "fetch_state"
    rank: int
    step: int
    slot: Literal["own", "replica", "rank", "any"] = "any"
    part: Literal["all", "manifest", "range"] = "all"
    offset: int = 0
    length: int = 0
    digest: str = ""  # a range's digest per the manifest (hex): what a source not sealed uses


@dataclass(frozen=True)
class StateBlob:
    """A snapshot: body part 0 is the layout JSON (`layout_nbytes`), part 1 the `nbytes` of data
    (whose part digest is the snapshot's digest). Answering a FetchState `part`: "manifest"
    sends the leaf digests (32 bytes each) as part 1 instead of the data, "range" no layout
    and the data bytes from `offset` as part 1 (its digest: `range_digest` of the leaves)."""
    TYPE: ClassVar[str] = "state_blob"
    rank: int
    step: int
    nbytes: int
    layout_nbytes: int = 0
    part: Literal["all", "manifest", "range"] = "all"
    offset: int = 0


@dataclass(frozen=True)
class Holdings:
    """What a rank can restore from, sent right before its `ready` heartbeat after a fault:
    the controller picks a restore step only where every position of the next generation has
    a copy (its own, a ring replica, or disk). `rank` is the position it held (-1: none yet);
    `own`: steps of its own snapshot (the whole state in replicated mode, the shared state in
    jit mode); `rank_own`: steps of its own per-rank state; `replicas`: rank -> steps of that
    rank's state kept here; `error`: the failure that ended its generation; `shard_keys`: see
    below."""
    TYPE: ClassVar[str] = "holdings"
    rank: int
    generation: int
    mode: Literal["jit", "replicated"]
    rank_state: bool
    own: list[int]
    rank_own: list[int]
    replicas: dict[int, list[int]]
    error: str = ""
    # A sharded job's shard key of every rank (layout_rules.MeshSpec), by rank: ranks with the
    # same key hold the same state. Empty: plain data parallelism (one key).
    shard_keys: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RelayHello:
    """The first frame of a node relay's connection (relay/node.py): from here on this
    one connection carries every local rank of `node`, in `Batch` frames both ways."""
    TYPE: ClassVar[str] = "relay_hello"
    job_id: str
    node: str
    role: Literal["active", "spare"]
    pid: int


@dataclass(frozen=True)
class Left:
    """Inside a relay's Batch: this local rank's connection to the relay ended (what an EOF
    on its own connection tells the controller on the per-rank path)."""
    TYPE: ClassVar[str] = "left"
    reason: str


@dataclass(frozen=True)
class Batch:
    """Several local ranks' messages in one frame of a node relay's connection: `items` are
    [local rank, message type, message fields]. The frame's MAC (the relay connection's
    Channel) covers all of them; each rank's own frames were authenticated on its own
    connection to the relay. Build one with `Batch.of`, read one with `messages()`."""
    TYPE: ClassVar[str] = "batch"
    # [local rank, message type, message fields] each: checked by messages(), in one pass
    # with building the messages (a relayed round decodes ~4 items per rank)
    items: list[Any]

    @classmethod
    def of(cls, pairs: "list[tuple[int, Any]]") -> "Batch":
        return cls([[lr, msg.TYPE, _fields_json(msg)] for lr, msg in pairs])

    def messages(self) -> "list[tuple[int, Any]]":
        """(local rank, message) pairs, each checked like a frame's own message; a relay's
        own messages (a Batch, a RelayHello) never nest."""
        out = []
        for i, item in enumerate(self.items):
            if not (isinstance(item, list) and len(item) == 3 and type(item[0]) is int
                    and type(item[1]) is str):
                raise ProtocolError(f"batch.items[{i}] must be [local rank, type, fields], "
                                    f"got {item!r:.80}")
            lr, type_name, fields = item
            if type_name in (Batch.TYPE, RelayHello.TYPE):
                raise ProtocolError(f"batch.items[{i}]: a {type_name} cannot be batched")
            if lr < 0:
                raise ProtocolError(f"batch.items[{i}]: local rank {lr} is negative")
            out.append((lr, _build(type_name, fields)))
        return out


Message = Union[Register, Heartbeat, Stop, Assign, Resume, StepDone, Ack, Goodbye,
                FetchState, StateBlob, Holdings, RelayHello, Left, Batch]
MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in typing.get_args(Message)}
_HINTS: dict[type, dict[str, Any]] = {cls: typing.get_type_hints(cls) for cls in MESSAGE_TYPES.values()}
# each message type's fields by name, looked up once (every incoming frame is built from them)
_FIELDS: dict[type, dict[str, dataclasses.Field]] = {
    cls: {f.name: f for f in dataclasses.fields(cls)} for cls in MESSAGE_TYPES.values()}
# what _build checks each field against: (name, annotation, required, its name in errors),
# prepared once instead of per field of every frame (a relayed round decodes ~4 per rank)
_SPECS: dict[type, list[tuple[str, Any, bool, str]]] = {
    cls: [(name, _HINTS[cls][name], f.default is dataclasses.MISSING
           and f.default_factory is dataclasses.MISSING, f"{cls.TYPE}.{name}")
          for name, f in fields.items()] for cls, fields in _FIELDS.items()}


@dataclass(frozen=True)
class Envelope:
    """A decoded, authenticated frame; `digests` are the verified digests of its body parts."""
    msg: Any
    job_id: str
    seq: int
    body: memoryview = memoryview(b"")
    digests: tuple[bytes, ...] = ()


# ---------------------------------------------------------------------------------------------
# Field validation: JSON only has str keys and lists, so values are coerced back to the
# annotated types, and anything else is a clear error rather than a crash later.

@functools.lru_cache(maxsize=None)
def _shape(tp: Any) -> tuple[Any, tuple]:
    """A generic annotation's origin and arguments, looked up once per annotation (typing's
    get_origin was a third of the controller's decoding time at 4,096 ranks: bench scale)."""
    return typing.get_origin(tp), typing.get_args(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    # the plain types first: most fields are ints and strings
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"field {where} must be an int, got {value!r:.80}")
        return value
    if tp is str or tp is bool:
        if not isinstance(value, tp):
            raise ProtocolError(f"field {where} must be a {tp.__name__}, got {value!r:.80}")
        return value
    if tp is Any:  # a nested message's fields: checked when that message is built
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"field {where} must be a number, got {value!r:.80}")
        return float(value)
    origin, args = _shape(tp)
    if origin is Literal:
        if value not in args:
            raise ProtocolError(f"field {where} must be one of {args}, got {value!r:.80}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"field {where} must be a list, got {value!r:.80}")
        (item,) = args
        if item is Any:  # checked where it is used (a Batch's items: Batch.messages)
            return list(value)
        # fast path (an Assign's member list at 2,000 nodes): one type check per element,
        # the per-element message is only built for a bad list
        if item is str and all(type(v) is str for v in value):
            return list(value)
        if item is int and all(type(v) is int for v in value):
            return list(value)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        items = args
        if not isinstance(value, (list, tuple)) or len(value) != len(items):
            raise ProtocolError(f"field {where} must be a {len(items)}-item list, got {value!r:.80}")
        return tuple(_coerce(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, items)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"field {where} must be an object, got {value!r:.80}")
        ktp, vtp = args
        if ktp is str and vtp is Any:  # a Batch item's fields (JSON keys are strings)
            return dict(value)
        out = {}
        for k, v in value.items():
            if ktp is int:
                try:
                    key = int(k)
                except (TypeError, ValueError):
                    raise ProtocolError(f"field {where} key {k!r:.40} is not an int") from None
            else:
                key = _coerce(k, ktp, f"{where} key")
            out[key] = _coerce(v, vtp, f"{where}[{k!r:.40}]")
        return out
    raise TypeError(f"unsupported field annotation {tp!r}")  # a bug in this module, not input


def _build(type_name: Any, fields: Any) -> Any:
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r:.80}")
    if not isinstance(fields, dict):
        raise ProtocolError(f"{type_name}: 'fields' must be an object, got {fields!r:.80}")
    extra = fields.keys() - _FIELDS[cls].keys()
    if extra:
        raise ProtocolError(f"{type_name}: unknown fields {sorted(extra)!r:.120}")
    kwargs = {}
    for name, tp, required, where in _SPECS[cls]:
        if name in fields:
            kwargs[name] = _coerce(fields[name], tp, where)
        elif required:
            raise ProtocolError(f"{type_name}: missing field {name!r}")
    return cls(**kwargs)


@functools.lru_cache(maxsize=4)
def _expand_hostlist(hostlist: str) -> tuple[str, ...]:
    from ..slurm.hostlist import expand
    try:
        return tuple(expand(hostlist))
    except HpctError as exc:
        raise ProtocolError(f"assign.members_hostlist: {exc.message}") from None


def _fields_json(msg: Any) -> dict:
    if type(msg) not in _HINTS:
        raise ProtocolError(f"cannot send {type(msg).__name__}: not a protocol message")
    # Shallow: message fields are JSON values (no nested dataclasses), and asdict's deep copy
    # of every element cost 1 ms per Assign at 2,000 nodes (bench scale).
    return {name: getattr(msg, name) for name in _FIELDS[type(msg)]}

