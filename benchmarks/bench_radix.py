"""Micro-benchmark of the radix tree alone (no model): match, insert, evict and metadata size.

A tree of ~1M cached tokens is built from 10k sequences that share prefixes: ``groups`` long shared
prefixes (system prompts, few-shot blocks) and, under each, sequences that add their own tail. Then:

- match: µs per ``match_prefix`` of a 4k-token prompt (a cached group prefix plus an uncached tail);
- insert: µs per insert of a finished 4k-token sequence whose prefix is cached (the common case);
- evict: µs per 1k evicted tokens, LRU;
- metadata: bytes per cached token of everything the tree holds besides the KV itself (node objects,
  keys, child dicts, slot-index tensors).

Usage: python benchmarks/bench_radix.py [--page-size 1 16] [--sequences 10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import tracemalloc
from array import array

import torch
from tqdm import tqdm

from radix import PagedAllocator, RadixCache, ReqToTokenPool


def build_sequences(n_seq: int, groups: int, prefix_len: int, tail_len: int, seed: int) -> list[array]:
    rng = random.Random(seed)
    prefixes = [array("i", (rng.randrange(49152) for _ in range(prefix_len))) for _ in range(groups)]
    seqs = []
    for i in range(n_seq):
        tail = array("i", (rng.randrange(49152) for _ in range(tail_len)))
        seqs.append(prefixes[i % groups] + tail)
    return seqs


def tensor_bytes(cache: RadixCache) -> int:
    total = 0
    for v in cache.owned_slots():
        total += v.numel() * v.element_size() + sys.getsizeof(v)
    return total


def run(page_size: int, n_seq: int, groups: int, prefix_len: int, tail_len: int, seed: int) -> dict:
    seqs = build_sequences(n_seq, groups, prefix_len, tail_len, seed)
    capacity = groups * prefix_len + n_seq * tail_len + 64 * 1024
    alloc = PagedAllocator(capacity, page_size=page_size)
    cache = RadixCache(alloc, ReqToTokenPool(1, 8))

    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    for s in tqdm(seqs, desc=f"build tree (page {page_size})", unit="seq"):
        n = len(s) // page_size * page_size
        m = cache.match_prefix(s[:n], record=False)
        new = alloc.alloc(n - m.length)
        cached = cache.insert(s[:n], torch.cat([m.kv_indices, new]))
        assert cached == m.length
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    py_bytes = sum(st.size_diff for st in snap1.compare_to(snap0, "filename"))
    cached_tokens = cache.stats().cached_tokens
    nodes = cache.stats().num_nodes
    index_bytes = tensor_bytes(cache)

    rng = random.Random(seed + 1)
    # match: 4k-token prompts = a cached group prefix + fresh tokens
    probes = []
    for _ in range(500):
        g = seqs[rng.randrange(len(seqs))]
        probe = g[:4000] + array("i", (rng.randrange(49152) for _ in range(96)))
        probes.append(probe)
    t0 = time.perf_counter()
    hit = 0
    for p in probes:
        hit += cache.match_prefix(p, record=False).length
    match_us = (time.perf_counter() - t0) / len(probes) * 1e6

    # insert: finished sequences (cached prefix + new tail), page-aligned
    n_ins, spent = 300, 0.0
    for _ in range(n_ins):
        g = seqs[rng.randrange(len(seqs))]
        s = g[:4000] + array("i", (rng.randrange(49152) for _ in range(96)))
        n = len(s) // page_size * page_size
        slots = alloc.alloc(n)
        t0 = time.perf_counter()
        cached = cache.insert(s[:n], slots)
        spent += time.perf_counter() - t0
        alloc.free(slots[:cached])
    insert_us = spent / n_ins * 1e6

    # evict: LRU leaves, 1k tokens at a time
    rounds = 200
    t0 = time.perf_counter()
    evicted = 0
    for _ in range(rounds):
        evicted += cache.evict(1024).numel()
    evict_us_per_1k = (time.perf_counter() - t0) / (evicted / 1000) * 1e6
    cache.check_integrity()
    return {
        "page_size": page_size,
        "sequences": n_seq,
        "cached_tokens": cached_tokens,
        "nodes": nodes,
        "match_4k_us": round(match_us, 1),
        "mean_match_len": hit / len(probes),
        "insert_4k_us": round(insert_us, 1),
        "evict_per_1k_tokens_us": round(evict_us_per_1k, 1),
        # tracemalloc sees Python objects (nodes, keys, dicts); torch's slot tensors live outside it
        "python_bytes_per_token": round(py_bytes / cached_tokens, 2),
        "index_tensor_bytes_per_token": round(index_bytes / cached_tokens, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--sequences", type=int, default=10_000)
    ap.add_argument("--groups", type=int, default=40)
    ap.add_argument("--prefix-len", type=int, default=5_000)
    ap.add_argument("--tail-len", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = [
        run(ps, args.sequences, args.groups, args.prefix_len, args.tail_len, args.seed)
        for ps in args.page_size
    ]
    for r in results:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
