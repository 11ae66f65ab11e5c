"""Which prefix cache a scheduler runs: the non-sharing baseline, the radix tree, or the radix tree over a
memory hierarchy (host pool, then an optional disk tier)."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from radix.base import PrefixCache
from radix.disk_cache import DiskTieredRadixCache
from radix.disk_format import KVFingerprint, canonical_json, dtype_name, tokenizer_digest, weights_digest
from radix.disk_store import DiskKVStore, DiskTierError
from radix.disk_tier import DiskTier
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
    kv = runner.kv_pages  # every KV head, whatever the tensor-parallel split: the tiers hold unsplit pages
    size = int(args.hicache_size * GB) if args.hicache_size > 0 else None
    tokens = host_capacity_tokens(runner.allocator.capacity, kv.page_size, kv.shape,
                                  ratio=None if size else args.hicache_ratio, size_bytes=size)
    pool = HostKVPool.for_device(kv, tokens)
    logger.info("hierarchical cache: host pool of %d tokens (%.1f MB, %.1fx the KV pool), %s",
                tokens, tokens * kv.shape.bytes_per_token / 2**20, tokens / runner.allocator.capacity,
                args.hicache_write_policy)
    if args.hicache_storage_backend is None:
        return HierarchicalRadixCache(runner.allocator, runner.req_to_token, kv, pool, args.hicache_write_policy,
                                      args.eviction_policy, event_sink)
    disk = open_disk_tier(args, runner)
    return DiskTieredRadixCache(runner.allocator, runner.req_to_token, kv, pool, disk, args.hicache_write_policy,
                                args.eviction_policy, event_sink)


def open_disk_tier(args: ServerArgs, runner: Any) -> DiskTier:
    """The 'file' storage backend: a ``DiskKVStore`` in --hicache-storage-dir for this server's fingerprint.
    A directory that cannot be used is a start-up error naming the flag."""
    assert args.hicache_storage_dir is not None
    fp = kv_fingerprint(args, runner)
    capacity = int(args.hicache_storage_size * GB) if args.hicache_storage_size else None
    try:
        store = DiskKVStore(args.hicache_storage_dir, fp, capacity)
    except DiskTierError as e:
        raise ValueError(f"--hicache-storage-dir {args.hicache_storage_dir}: {e}") from e
    disk = DiskTier(store, runner.kv_pages.shape, runner.kv_pages.page_size)
    logger.info("disk KV tier: %s holds %d blocks (%.1f MB) for this model; blocks of %d tokens, capacity %s",
                   store.directory, len(store), store.bytes_used / 2**20, disk.block_tokens,
                   f"{args.hicache_storage_size} GB" if capacity else "unbounded")
    return disk


def kv_fingerprint(args: ServerArgs, runner: Any) -> KVFingerprint:
    """Everything that makes this server's KV what it is (``radix.disk_format``): blocks written under
    another fingerprint are never read."""
    cfg = runner.hf_config
    if runner.random_weights:
        # no files: the weights are drawn from the seed, on the device (CPU and CUDA draw differently)
        text = f"{args.model}|seed={args.random_seed}|{runner.device.type}|{dtype_name(runner.kv_pages.shape.dtype)}"
        weights = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    else:
        weights = weights_digest([runner.model_path])
    try:
        tokenizer = tokenizer_digest(args.tokenizer or runner.model_path)
    except FileNotFoundError:
        tokenizer = "none"  # a tokenizer kept inside the weights (GGUF) is covered by their digest
    shape = runner.kv_pages.shape  # every KV head: blocks are the same at any tensor-parallel size
    # numerics that change the KV bits without changing the model: a deterministic server must only read KV
    # that deterministic kernels computed, and int8 weights give other KV than float ones
    numerics = {"deterministic": bool(args.enable_deterministic_inference), "quantization": args.quantization,
                "sliding_window": getattr(cfg, "sliding_window", None)}
    if args.kv_cache_dtype != "auto":  # only then, so that the blocks of float pools keep their fingerprint
        numerics["kv_cache_dtype"] = args.kv_cache_dtype
    # A row-parallel layer sums in tp pieces: KV differs across tp sizes by float rounding only, as it does
    # across batch compositions, so blocks are shared between tp sizes, except where bits are promised
    # (deterministic mode is batch-invariant, not tp-invariant) or the split changes the model (int8 scales
    # are per shard).
    tp_bound = args.enable_deterministic_inference or args.quantization != "none"
    return KVFingerprint(
        weights=weights,
        kv_dtype=dtype_name(shape.dtype),
        page_size=runner.kv_pages.page_size,
        num_layers=shape.num_layers,
        kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        tokenizer=tokenizer,
        rope_theta=float(getattr(cfg, "rope_theta", 10000.0) or 10000.0),
        rope_scaling=canonical_json(getattr(cfg, "rope_scaling", None)),
        max_positions=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        attention=canonical_json(numerics),
        tp_size=args.tp_size if tp_bound else 1,
        namespace="default",
    )
