"""The pieces of the tiered cache that are not the tree: its node type, the lower-tier hook, load results.

See ``radix.hierarchical_cache`` for the rules these serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from radix.base import MatchResult
from radix.host_pool import HostKVPool, TransferHandle
from radix.radix_cache import TreeNode

WRITE_POLICIES = ("write_through", "write_back")


class TieredNode(TreeNode):
    """A tree node that may hold its KV on the host as well as (or instead of) on the device."""

    __slots__ = ("device_children", "host_evict_key", "host_value")

    def __init__(self, node_id: int, key: bytes, value: torch.Tensor, parent: TreeNode | None):
        super().__init__(node_id, key, value, parent)
        self.host_value: torch.Tensor | None = None  # host slot of each token, when backed up
        self.host_evict_key: tuple | None = None  # filed in the host eviction index (host-only leaves)
        self.device_children = 0  # children on the device: 0 makes a device-resident node a device leaf

    @property
    def on_device(self) -> bool:
        return self.parent is None or self.value.numel() > 0

    @property
    def tier(self) -> str:
        if self.parent is None or self.host_value is None:
            return "device"
        return "device+host" if self.value.numel() else "host"


def node_path(node: TreeNode) -> list[TieredNode]:
    """Nodes from just below the root down to ``node`` (of a tiered tree: every node is a ``TieredNode``)."""
    path: list[TieredNode] = []
    while node.parent is not None:
        assert isinstance(node, TieredNode)
        path.append(node)
        node = node.parent
    path.reverse()
    return path


class LowerTier(Protocol):
    """Where host-only blocks go when the host pool drops them (a disk tier); called before the slots
    are freed, so ``pool.k_buffer[:, host_slots]`` still holds their KV."""

    def on_host_evict(
        self, node: TieredNode, block_hashes: list[int] | None, host_slots: torch.Tensor, pool: HostKVPool
    ) -> None: ...


@dataclass
class LoadBack:
    """What ``load_back`` did: the whole prefix as a device match, the fresh device slots, the copy."""

    match: MatchResult
    slots: torch.Tensor
    handle: TransferHandle
