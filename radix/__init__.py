"""radix/: the radix-tree prefix cache over paged KV memory (no model, no scheduler)."""

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.base import CacheStats, MatchResult, PrefixCache, ReqKV, key_bytes
from radix.errors import (
    DoubleFreeError,
    IntegrityError,
    KVCacheError,
    KVOutOfMemoryError,
    UnownedSlotError,
)
from radix.events import AllBlocksCleared, BlocksRemoved, BlocksStored, CacheEvent, CacheMirror
from radix.eviction import LFUPolicy, LRUPolicy, make_policy
from radix.hierarchical_cache import HierarchicalRadixCache
from radix.host_pool import HostKVPool, TransferHandle, host_capacity_tokens
from radix.kv_storage import KVPages, KVShape, KVStorage
from radix.naive_cache import NaiveCache
from radix.radix_cache import RadixCache, TreeNode
from radix.tiered_node import WRITE_POLICIES, LoadBack, LowerTier, TieredNode

__all__ = [
    "WRITE_POLICIES",
    "AllBlocksCleared",
    "BlocksRemoved",
    "BlocksStored",
    "CacheEvent",
    "CacheMirror",
    "CacheStats",
    "DoubleFreeError",
    "HierarchicalRadixCache",
    "HostKVPool",
    "IntegrityError",
    "KVCacheError",
    "KVOutOfMemoryError",
    "KVPages",
    "KVShape",
    "KVStorage",
    "LFUPolicy",
    "LRUPolicy",
    "LoadBack",
    "LowerTier",
    "MatchResult",
    "NaiveCache",
    "PagedAllocator",
    "PrefixCache",
    "RadixCache",
    "ReqKV",
    "ReqToTokenPool",
    "TieredNode",
    "TransferHandle",
    "TreeNode",
    "UnownedSlotError",
    "host_capacity_tokens",
    "key_bytes",
    "make_policy",
]
