"""Where a node's replicas live on the ring of nodes (pure): half the ring away.

A rank's replica (its own state in jit mode, its whole snapshot in replicated mode) is kept by
the same local rank on the node half the node order away; the controller (pacing.py), the
restore (restore.py), the carried replicas (carry.py) and the snapshot policy's pusher all
place it by these functions.
"""
from __future__ import annotations

from ..errors import HpctError


def ring_offset(num_nodes: int) -> int:
    """How far along the node order a node's replicas live: half the ring. Neighbours in the
    node order (n2, n3) tend to share a rack, a switch or a power feed, so the copy of a node's
    state goes to the node farthest from it; two adjacent nodes lost together then never take
    a state and its only replica with them."""
    return max(1, num_nodes // 2)


def replica_peer(node_index: int, num_nodes: int) -> int:
    """The node that holds replicas of `node_index`'s ranks: half the ring away."""
    if num_nodes < 2:
        raise HpctError(f"replicas need at least 2 nodes, got num_nodes={num_nodes}")
    if not 0 <= node_index < num_nodes:
        raise HpctError(f"node_index {node_index} is outside 0..{num_nodes - 1}")
    return (node_index + ring_offset(num_nodes)) % num_nodes


def replica_source_node(node_index: int, num_nodes: int) -> int:
    """The node whose ranks' replicas `node_index` holds (half the ring back)."""
    replica_peer(node_index, num_nodes)
    return (node_index - ring_offset(num_nodes)) % num_nodes


def replica_peer_rank(rank: int, num_nodes: int, tasks_per_node: int) -> int:
    """The rank that holds `rank`'s replica: same local rank on the node half the ring away."""
    node, local = divmod(rank, tasks_per_node)
    return replica_peer(node, num_nodes) * tasks_per_node + local


def ranks_held_by(node_index: int, num_nodes: int, tasks_per_node: int) -> list[int]:
    """Ranks whose replicas live on node `node_index` (one per local rank)."""
    src = replica_source_node(node_index, num_nodes)
    return [src * tasks_per_node + local for local in range(tasks_per_node)]
