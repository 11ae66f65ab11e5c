"""The scheduler's read-only answers for the dashboard: the cache tree and the cheap live figures.

Both run on the scheduler's thread between two steps (``SchedulerLoop``'s control queries), so they see a consistent
tree and pools without locks. Neither drains an in-flight overlap batch (its results are applied at the
next step, as usual) and neither runs the integrity check that /get_server_info does: the dashboard polls
every second and must not slow the steps down. The KV figures are the allocator's and the cache's own
counters; what running requests hold privately is the rest of the capacity (the accounting invariant).
"""

from __future__ import annotations

import time
from typing import Any

from radix.radix_cache import RadixCache
from radix.snapshot import SnapshotNode, TreeSnapshot

PREVIEW_TOKENS = 32  # token ids sent per node for its text preview (decoded in the main process)


def cache_tree(scheduler: Any, max_nodes: int, min_tokens: int) -> dict[str, Any]:
    cache = scheduler.cache
    if isinstance(cache, RadixCache):
        snap = cache.snapshot(max_nodes, min_tokens, PREVIEW_TOKENS)
    else:  # --disable-radix-cache: nothing is kept, the tree is empty
        snap = TreeSnapshot([SnapshotNode(0, None, 0, 0, 0, 0, 0, label="cache")], 0, 0, 0)
    return {**snap.to_json(), "page_size": cache.page_size, "enabled": isinstance(cache, RadixCache)}


def live_stats(scheduler: Any) -> dict[str, Any]:
    """The dashboard's sample: ``Scheduler.status()`` (the figures /metrics gets too), in the dashboard's shape."""
    st = scheduler.status()
    return {
        "time": time.time(),
        "num_running_reqs": st.num_running,
        "num_waiting_reqs": st.num_waiting,
        "kv": {"free": st.kv_free, "evictable": st.kv_evictable, "protected": st.kv_protected,
               "private": st.kv_private, "capacity": st.capacity},
        "cache": {"hit_tokens": st.hit_tokens, "miss_tokens": st.miss_tokens, "hit_rate": st.cache_hit_rate,
                  "cached_tokens": st.cached_tokens, "num_nodes": st.cache_nodes,
                  "evicted_tokens": st.evicted_tokens},
        "scheduler": {"steps": st.forward_steps, "prefill_tokens": st.prefill_tokens,
                      "decode_tokens": st.decode_tokens, "forward_seconds": st.forward_seconds,
                      "finished_requests": st.finished_requests},
    }
