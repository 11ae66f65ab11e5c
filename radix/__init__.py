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
from radix.kv_storage import KVShape, KVStorage
from radix.naive_cache import NaiveCache
from radix.radix_cache import RadixCache, TreeNode

__all__ = [
    "AllBlocksCleared",
    "BlocksRemoved",
    "BlocksStored",
    "CacheEvent",
    "CacheMirror",
    "CacheStats",
    "DoubleFreeError",
    "IntegrityError",
    "KVCacheError",
    "KVOutOfMemoryError",
    "KVShape",
    "KVStorage",
    "LFUPolicy",
    "LRUPolicy",
    "MatchResult",
    "NaiveCache",
    "PagedAllocator",
    "PrefixCache",
    "RadixCache",
    "ReqKV",
    "ReqToTokenPool",
    "TreeNode",
    "UnownedSlotError",
    "key_bytes",
    "make_policy",
]
