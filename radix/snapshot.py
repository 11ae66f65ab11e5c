"""A read-only, size-bounded copy of a radix tree, for dashboards (``RadixCache.snapshot``).

A cache can hold hundreds of thousands of nodes; a page can draw a few thousand at most. The snapshot
keeps the nodes that hold the most tokens (their own plus their descendants'), chosen best-first from
the roots, and folds the rest of each shown node's children into one *aggregate* node that carries
their total tokens, so every level of the picture still adds up to the tokens the tree holds.

Cost: one pass over the tree (subtree sizes) and a heap over the shown nodes' children. It runs in the
scheduler process between two steps (it never mutates anything), so it always sees a consistent tree.
Aggregates need no pass of their own: a match touches, counts and locks every node on its path, so the
top node of a hidden subtree has the subtree's latest access, its largest lock count and its hits.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from array import array
from collections.abc import Hashable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

TIER = "device"  # where a node's KV lives: "device", "host" or "device+host" (aggregates and roots: device)


class _Node(Protocol):
    key: bytes
    children: dict[bytes, Any]
    lock_ref: int
    last_access: int
    hit_count: int
    node_id: int

    @property
    def tier(self) -> str: ...


@dataclass
class SnapshotNode:
    """One node of the picture: a tree node, a namespace root, or an aggregate of hidden subtrees."""

    id: int  # a tree node's id; 0 for the root of the picture; negative for namespaces and aggregates
    parent: int | None
    tokens: int  # the node's own tokens (an aggregate: every token of the subtrees it stands for)
    subtree_tokens: int
    hits: int
    last_access: int  # the cache's logical clock (larger = more recent); compare with TreeSnapshot.clock
    lock_count: int  # requests holding the node (> 0: in use, not evictable)
    preview_ids: list[int] = field(default_factory=list)  # the first token ids of the node's key
    aggregated: int = 0  # > 0: an aggregate standing for this many hidden nodes
    label: str | None = None  # namespaces and aggregates: what they are
    tier: str = TIER


@dataclass
class TreeSnapshot:
    nodes: list[SnapshotNode]
    total_nodes: int  # nodes in the tree (namespace roots excluded)
    total_tokens: int
    clock: int  # the latest access the tree has seen

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [asdict(n) for n in self.nodes], "total_nodes": self.total_nodes,
                "total_tokens": self.total_tokens, "clock": self.clock}


def namespace_label(namespace: Hashable) -> str:
    # a cache salt may be a secret: show a short digest of it, never the salt itself
    return "namespace " + hashlib.blake2b(repr(namespace).encode(), digest_size=4).hexdigest()


def build_snapshot(roots: Mapping[Hashable | None, _Node], max_nodes: int, min_tokens: int,
                   preview_tokens: int) -> TreeSnapshot:
    """At most ``max_nodes`` nodes (aggregates included, ``>= 2``); subtrees under ``min_tokens`` are folded."""
    if max_nodes < 2:
        raise ValueError("max_nodes: must be at least 2")
    # pass 1: tokens and node count of every subtree (iterative post-order)
    order: list[_Node] = []
    stack = [c for r in roots.values() for c in r.children.values()]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    sub: dict[_Node, tuple[int, int]] = {}
    for node in reversed(order):
        tokens, count = len(node.key) >> 2, 1
        for c in node.children.values():
            t, n = sub[c]
            tokens += t
            count += n
        sub[node] = (tokens, count)
    total_tokens = sum(sub[c][0] for r in roots.values() for c in r.children.values())
    clock = max((r.last_access for r in roots.values()), default=0)

    synthetic = itertools.count(-1, -1)
    nodes = [SnapshotNode(0, None, 0, total_tokens, 0, clock, 0, label="cache")]
    seq = itertools.count()
    # heap items: (-subtree tokens, tie-break, tree node, parent id in the picture, namespace or None)
    heap: list[tuple[int, int, _Node, int, Any]] = []
    remaining: dict[int, int] = {}  # picture id -> its children not shown yet

    def push_children(node: _Node, pid: int) -> None:
        for c in node.children.values():
            heapq.heappush(heap, (-sub[c][0], next(seq), c, pid, None))
        if node.children:
            remaining[pid] = remaining.get(pid, 0) + len(node.children)

    ns_tokens: dict[int, tuple[int, int]] = {}
    for ns, root in roots.items():
        if ns is None:
            push_children(root, 0)
        elif root.children:
            tokens = sum(sub[c][0] for c in root.children.values())
            ns_tokens[id(root)] = (tokens, sum(sub[c][1] for c in root.children.values()))
            heapq.heappush(heap, (-tokens, next(seq), root, 0, ns))
            remaining[0] = remaining.get(0, 0) + 1
    shown = 1 + (1 if remaining.get(0) else 0)  # the root, and one aggregate slot for each parent with hidden children
    while heap and -heap[0][0] >= min_tokens:
        neg, _, node, pid, ns = heap[0]
        grows = 1 + (1 if node.children else 0) - (1 if remaining[pid] == 1 else 0)
        if shown + grows > max_nodes:
            break
        heapq.heappop(heap)
        shown += grows
        remaining[pid] -= 1
        if ns is not None:  # a namespace root
            nid = next(synthetic)
            nodes.append(SnapshotNode(nid, pid, 0, -neg, node.hit_count, node.last_access, 0,
                                      label=namespace_label(ns)))
        else:
            nid = node.node_id
            nodes.append(SnapshotNode(nid, pid, len(node.key) >> 2, -neg, node.hit_count, node.last_access,
                                      node.lock_ref, array("i", node.key[: 4 * preview_tokens]).tolist(),
                                      tier=node.tier))
        push_children(node, nid)

    # what is left in the heap is hidden: one aggregate per shown parent
    hidden: dict[int, list[tuple[_Node, bool]]] = {}
    for _, _, node, pid, ns in heap:
        hidden.setdefault(pid, []).append((node, ns is not None))
    for pid, group in hidden.items():
        tokens = count = hits = last = locks = 0
        for node, is_ns in group:
            t, n = ns_tokens[id(node)] if is_ns else sub[node]
            tokens += t
            count += n
            hits += node.hit_count
            last = max(last, node.last_access)
            locks = max(locks, 0 if is_ns else node.lock_ref)
        nodes.append(SnapshotNode(next(synthetic), pid, tokens, tokens, hits, last, locks, aggregated=count,
                                  label=f"{count} more node{'s' if count != 1 else ''}"))
    return TreeSnapshot(nodes, len(order), total_tokens, clock)
