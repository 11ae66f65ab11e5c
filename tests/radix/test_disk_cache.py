"""The disk tier under the hierarchical cache (radix.disk_tier, radix.disk_cache), with real files and real K/V.

Every token's K/V is a pseudo-random function of its prefix (``kv_for`` of test_host_tier), written into the
device storage when a request computes it; a cache with a fresh tree over the same directory (a restart)
must load exactly those bits back, stop at a corrupt block, and keep its books balanced.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radix import KVShape, KVStorage, PagedAllocator, ReqToTokenPool
from radix.disk_cache import DiskTieredRadixCache
from radix.disk_format import KVFingerprint
from radix.disk_store import DiskKVStore
from radix.disk_tier import DiskTier, disk_block_tokens
from radix.events import chain_hashes, root_hash
from radix.host_pool import HostKVPool
from tests.radix.test_host_tier import SHAPE, kv_for

FP = KVFingerprint(weights="w" * 32, kv_dtype="float32", page_size=4, num_layers=SHAPE.num_layers,
                   kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim, tokenizer="t" * 32, rope_theta=1e4)


def make(root: Path, ps: int = 4, dev_tokens: int = 512, queue_bytes: int = 1 << 20,
         shape: KVShape = SHAPE) -> DiskTieredRadixCache:
    """A cache with an empty tree over the disk blocks in ``root`` (a fresh process, as far as the tree knows)."""
    alloc = PagedAllocator(dev_tokens, page_size=ps)
    kv = KVStorage(shape, alloc.total_slots, ps)
    host = HostKVPool.for_device(kv, 4 * dev_tokens)
    disk = DiskTier(DiskKVStore(root, FP, fsync=False), shape, ps, queue_bytes=queue_bytes)
    return DiskTieredRadixCache(alloc, ReqToTokenPool(8, 1024), kv, host, disk, "write_through")


def run(cache: DiskTieredRadixCache, tokens: list[int]) -> int:
    """Admit and compute ``tokens`` as the scheduler does (match, load, lock, compute the rest, cache it);
    checks that every loaded position holds the K/V computed for it. Returns the reused length."""
    key = tokens[: len(tokens) - 1]  # the scheduler always computes the last prompt token
    m = cache.load_to_device(cache.match_prefix(key, record=False), key)
    assert m.host_len == 0
    cache.record_lookup(m.length, len(tokens))  # attributes the loaded tokens to their tier
    got_k = cache.device_kv.k_buffer[:, m.kv_indices]
    got_v = cache.device_kv.v_buffer[:, m.kv_indices]
    want_k, want_v = kv_for(tokens, 0, m.length)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), "a loaded position holds other K/V"
    st = cache.new_request()
    cache.assign_prefix(st, m)
    slots = cache.alloc_tokens(st, len(tokens) - m.length)
    k, v = kv_for(tokens, m.length, len(tokens) - m.length)
    cache.device_kv.k_buffer[:, slots] = k
    cache.device_kv.v_buffer[:, slots] = v
    cache.cache_finished_req(st, tokens)
    cache.check_integrity()
    return m.length


def seq(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def block_file(root: Path, tokens: list[int], block: int) -> Path:
    h = chain_hashes(root_hash(None), bytes(torch.tensor(tokens, dtype=torch.int32).numpy()), 256)[block]
    (path,) = root.glob(f"*/blocks/*/{h:016x}.kv")
    return path


def test_a_fresh_tree_loads_the_blocks_bit_for_bit(tmp_path: Path) -> None:
    a = make(tmp_path)
    t = seq(230, 1)
    assert run(a, t) == 0
    a.disk.flush()
    rep = a.stats().disk
    assert rep["blocks_written"] == 3 and rep["queued_blocks"] == 0  # 229 computed tokens: 3 whole blocks
    b = make(tmp_path)
    assert run(b, t + [7, 8]) == 192
    s = b.stats()
    assert s.disk_hit_tokens == 192 and s.disk["blocks_read"] == 3 and s.disk["loads"] == 1
    assert run(b, t + [7, 8]) == 228  # now from the device: the tree holds what the load inserted, and more
    assert b.stats().disk["blocks_read"] == 3


def test_the_disk_continues_a_device_match_that_ends_inside_a_block(tmp_path: Path) -> None:
    t = seq(300, 2)
    b = make(tmp_path)
    assert run(b, t[:101]) == 0  # b's tree has 100 tokens of it (whole pages): block 0 and part of block 1
    b.disk.flush()
    a = make(tmp_path)
    assert run(a, t) == 64  # another process: block 0 from disk, the rest computed and written
    a.disk.flush()
    assert b.load_to_device(b.match_prefix(t[:100]), t[:100]).length == 100  # nothing past the key is loaded
    assert run(b, t) == 256  # blocks 1..3 come from disk, the first from position 100 on
    assert b.stats().disk_hit_tokens == 156  # positions 100..255; the first 100 were on the device


@pytest.mark.parametrize("bad", [0, 2])
def test_a_corrupt_block_stops_the_load_and_is_counted(tmp_path: Path, bad: int) -> None:
    a = make(tmp_path)
    t = seq(300, 3)
    run(a, t)
    a.disk.flush()
    path = block_file(tmp_path, t, bad)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # one bit of the last payload byte
    path.write_bytes(bytes(data))
    b = make(tmp_path)
    # the blocks before the bad one; it and those after it are recomputed (run checks every loaded bit, and
    # the cache's integrity: the slots made ready for the unread blocks are free again)
    assert run(b, t) == 64 * bad
    assert b.stats().disk["corrupted"] == 1
    b.disk.flush()  # the corrupt file was removed; the recomputed block is written again
    assert run(make(tmp_path), t) == 256


def test_no_room_on_the_device_leaves_the_match_alone(tmp_path: Path) -> None:
    a = make(tmp_path)
    t = seq(300, 4)
    run(a, t)
    a.disk.flush()
    b = make(tmp_path, dev_tokens=128)
    st = b.new_request()
    b.alloc_tokens(st, 100)  # a running request holds most of the pool
    m = b.load_to_device(b.match_prefix(t), t)
    assert m.length == 0 and b.allocator.free_size == 28
    b.check_integrity([st])
    b.release_req(st)
    b.check_integrity()


def test_a_full_write_queue_skips_blocks_and_counts_them(tmp_path: Path) -> None:
    block_bytes = SHAPE.bytes_per_token * 64
    a = make(tmp_path, dev_tokens=1024, queue_bytes=2 * block_bytes)
    t = seq(600, 5)
    run(a, t)  # 9 whole blocks, room for 2 in the queue
    a.disk.flush()
    rep = a.stats().disk
    assert rep["skipped_blocks"] == 7 and rep["blocks_written"] == 2
    assert run(make(tmp_path, dev_tokens=1024), t) == 128  # the two leading blocks, the ones a read can use


def test_block_size_is_a_whole_number_of_pages() -> None:
    assert disk_block_tokens(1) == 64 and disk_block_tokens(16) == 64 and disk_block_tokens(48) == 96


def test_another_fingerprint_never_reads_the_blocks(tmp_path: Path) -> None:
    a = make(tmp_path)
    t = seq(300, 6)
    run(a, t)
    a.disk.flush()
    alloc = PagedAllocator(512, page_size=4)
    kv = KVStorage(SHAPE, alloc.total_slots, 4)
    other = DiskKVStore(tmp_path, KVFingerprint(**{**FP.to_dict(), "weights": "x" * 32}), fsync=False)
    b = DiskTieredRadixCache(alloc, ReqToTokenPool(8, 1024), kv, HostKVPool.for_device(kv, 512),
                             DiskTier(other, SHAPE, 4))
    assert run(b, t) == 0 and b.stats().disk["blocks_read"] == 0


@pytest.mark.parametrize("ps", [1, 16])
def test_page_sizes(tmp_path: Path, ps: int) -> None:
    a = make(tmp_path / str(ps), ps=ps)
    t = seq(200, 7)
    run(a, t)
    a.disk.flush()
    assert run(make(tmp_path / str(ps), ps=ps), t) == 192


def test_a_prefill_chunk_is_written_before_the_request_ends(tmp_path: Path) -> None:
    a = make(tmp_path)
    t = seq(300, 8)
    st = a.new_request()
    slots = a.alloc_tokens(st, 150)  # the first chunk of a longer prompt
    k, v = kv_for(t, 0, 150)
    a.device_kv.k_buffer[:, slots] = k
    a.device_kv.v_buffer[:, slots] = v
    a.cache_unfinished_req(st, t[:150])
    a.disk.flush()
    assert a.stats().disk["blocks_written"] == 2
    assert run(make(tmp_path), t) == 128  # a fresh tree: both blocks of the chunk, from disk
    a.release_req(st)
    a.check_integrity()


def test_loaded_blocks_get_their_host_copy_when_evicted_not_when_loaded(tmp_path: Path) -> None:
    a = make(tmp_path)
    t = seq(300, 9)
    run(a, t)
    a.disk.flush()
    b = make(tmp_path)  # write_through
    key = t[:-1]
    m = b.load_to_device(b.match_prefix(key, record=False), key)
    assert m.length == 256 and b.stats().bytes_to_host == 0  # the disk has these: no copy on the way in
    b.evict(256)
    s = b.stats()
    assert s.bytes_to_host == 256 * SHAPE.bytes_per_token and s.host_only_tokens == 256  # copied on the way out
    again = b.match_prefix(key, record=False)
    assert again.length == 0 and again.host_len == 256
    back = b.load_back(again)  # and the host copy holds the KV that was loaded from disk
    back.handle.wait()
    want_k, want_v = kv_for(t, 0, 256)
    idx = back.match.kv_indices
    assert torch.equal(b.device_kv.k_buffer[:, idx], want_k) and torch.equal(b.device_kv.v_buffer[:, idx], want_v)
    b.check_integrity()
