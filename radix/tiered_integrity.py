"""The tiered cache's own books, checked from the outside: the host pool's accounting and the residency rules.

``HierarchicalRadixCache.check_integrity`` checks the device books as every cache does
(``PrefixCache.check_integrity``) and hands its nodes here. Kept apart from the cache so that the checker
reads only what it is given and shares no code path with the bookkeeping it audits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radix.allocator import PagedAllocator
from radix.errors import IntegrityError
from radix.radix_cache import TreeNode
from radix.tiered_node import TieredNode


def check_tiered_books(
    nodes: Iterable[TreeNode], host: PagedAllocator, loading: set[int], host_only_tokens: int
) -> dict[str, int]:
    """Check ``host free + host slots held by nodes == host capacity``, every host page one owner, the
    node-level rules of ``radix.hierarchical_cache`` (device residency prefix-closed, locked nodes on the
    device, every node on a tier, both eviction indexes holding exactly their leaves) and the cache's own
    count of host-only tokens. ``loading``: ids of nodes being loaded back (kept out of the host index).
    Returns the host figures; raises ``IntegrityError`` on the first broken rule."""
    ps = host.page_size
    owner: dict[int, str] = dict.fromkeys(host.free_page_set(), "free")
    held = host_only = 0
    for node in nodes:
        where = f"node {node.node_id}"
        if not isinstance(node, TieredNode) or not isinstance(node.parent, TieredNode):
            raise IntegrityError(f"{where} (or its parent) is not a tiered node")
        k = node.num_tokens
        if node.on_device and node.value.numel() != k:
            raise IntegrityError(f"{where} holds {node.value.numel()} device slots for {k} tokens")
        if node.on_device and not node.parent.on_device:
            raise IntegrityError(f"{where} is on the device below a host-only parent")
        if not node.on_device and node.host_value is None:
            raise IntegrityError(f"{where} is on no tier")
        if node.lock_ref and not node.on_device:
            raise IntegrityError(f"{where} is locked but not on the device")
        if node.device_children != sum(c.value.numel() > 0 for c in node.children.values()):
            raise IntegrityError(f"{where} miscounts its device children")
        dev_leaf = node.on_device and node.lock_ref == 0 and node.device_children == 0
        if (node.evict_key is not None) != dev_leaf:
            raise IntegrityError(f"{where}: device eviction index membership is wrong")
        host_leaf = not node.on_device and not node.children and node.node_id not in loading
        if (node.host_evict_key is not None) != host_leaf:
            raise IntegrityError(f"{where}: host eviction index membership is wrong")
        if node.host_value is None:
            continue
        if node.host_value.numel() != k:
            raise IntegrityError(f"{where} holds {node.host_value.numel()} host slots for {k} tokens")
        held += k
        host_only += 0 if node.on_device else k
        for page in torch.unique(node.host_value // ps).tolist():
            if page in owner:
                raise IntegrityError(f"host page {page} is owned by both {owner[page]} and {where}")
            owner[page] = where
    if len(owner) != host.num_pages:
        raise IntegrityError(f"{host.num_pages - len(owner)} host pages have no owner (leaked)")
    if host.free_size + held != host.capacity or host_only != host_only_tokens:
        raise IntegrityError(
            f"host accounting does not balance: free {host.free_size} + held {held} != capacity "
            f"{host.capacity}, or host-only {host_only} != {host_only_tokens}"
        )
    return {"host_free": host.free_size, "host_held": held, "host_capacity": host.capacity}
