"""Which prefix cache a scheduler runs: the non-sharing baseline, the radix tree, or the radix tree over a
memory hierarchy (host pool, then an optional disk tier)."""

from __future__ import annotations

import logging
from typing import Any

from radix.base import PrefixCache
from radix.hierarchical_cache import HierarchicalRadixCache
from radix.host_pool import HostKVPool, host_capacity_tokens
from radix.naive_cache import NaiveCache
from radix.radix_cache import RadixCache
from runtime.config import ServerArgs

logger = logging.getLogger(__name__)
GB = 1 << 30


def make_cache(args: ServerArgs, runner: Any, event_sink: Any = None) -> PrefixCache:
    """The cache ``args`` ask for over ``runner``'s KV pool (allocator, request table, KV storage)."""
    if args.disable_radix_cache:
        return NaiveCache(runner.allocator, runner.req_to_token)
    if not args.enable_hierarchical_cache:
        return RadixCache(runner.allocator, runner.req_to_token, args.eviction_policy, event_sink)
    kv = runner.kv
    size = int(args.hicache_size * GB) if args.hicache_size > 0 else None
    tokens = host_capacity_tokens(runner.allocator.capacity, kv.page_size, kv.shape,
                                  ratio=None if size else args.hicache_ratio, size_bytes=size)
    pool = HostKVPool.for_device(kv, tokens)
    logger.info("hierarchical cache: host pool of %d tokens (%.1f MB, %.1fx the KV pool), %s",
                tokens, tokens * kv.shape.bytes_per_token / 2**20, tokens / runner.allocator.capacity,
                args.hicache_write_policy)
    return HierarchicalRadixCache(runner.allocator, runner.req_to_token, kv, pool, args.hicache_write_policy,
                                  args.eviction_policy, event_sink)
