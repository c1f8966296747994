"""Proof that a restore reached the objects a rank trains with.

A restore loads a snapshot into the objects registered at that moment. A script can still
train with other objects: one built again and registered after the restore (the inline form's
`main()` runs again from its top), one it never registered, one whose state it reset after
the restore. Each of those trains on silently with a state the uninterrupted run never had.
So every restore records, per registered name, the digest of the state it restored, and at
the first step boundary after it (`Job`) the live objects' state is hashed the same way and
compared: a name whose live state differs, a restored name nobody registered, a registered
name the restore held nothing for. Any of them and the rank does not train on.

The digest is a BLAKE3 hash over a snapshot's encoded tree (encoding.py's `encode`): the tags,
the scalars as JSON, every tensor's dtype, shape and bytes. Both sides are hashed from that
encoding, the restored side from the snapshot's own tree and buffer, the live side from the
objects' `state_dict()`, so equal states hash equal whatever their origin. A shard's mesh
coordinate is left out: a replica restored at another coordinate of a replicated dimension
(HSDP) holds the same bytes.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import blake3
import torch

_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


DIGEST_BYTES = 16


def tensor_bytes(t: torch.Tensor) -> bytes | memoryview:
    """What a tensor adds to a digest by default: all of its bytes (a GPU tensor's copied to
    the host: a proof runs once per restore, a plain copy is fine there)."""
    t = t.detach()
    if t.is_cuda:
        t = t.cpu()
    if not t.numel():
        return b""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def tree_digest(node: Any, tensors: Sequence[torch.Tensor],
                content: Callable[[torch.Tensor], bytes | memoryview] = tensor_bytes) -> bytes:
    """The digest of one encoded subtree (`node`), whose tensor references index `tensors`:
    its structure, every tensor's dtype and shape, and what `content` makes of each tensor
    (its bytes; the replicas' cross-check gives a sum of them, crosscheck.py)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    _feed(h, node, tensors, content)
    return h.digest(DIGEST_BYTES)


def _feed(h: Any, node: Any, tensors: Sequence[torch.Tensor], content: Callable) -> None:
    if not isinstance(node, dict):
        h.update(b"s" + _JSON.encode(node).encode() + b"\0")
        return
    (tag, value), = node.items()
    if tag == "T":
        _feed_tensor(h, b"T", tensors[value], content)
    elif tag == "D":
        idx, meta = value
        shape = {k: v for k, v in meta.items() if k != "coord"}
        h.update(b"D" + _JSON.encode(shape).encode())
        _feed_tensor(h, b"", tensors[idx], content)
    elif tag in ("l", "t", "d"):
        h.update(tag.encode() + len(value).to_bytes(8, "little"))
        for item in value:
            if tag == "d":
                _feed(h, item[0], tensors, content)
                _feed(h, item[1], tensors, content)
            else:
                _feed(h, item, tensors, content)
    else:
        h.update(b"?" + _JSON.encode(node).encode())


def _feed_tensor(h: Any, tag: bytes, t: torch.Tensor, content: Callable) -> None:
    h.update(tag + f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(content(t))
