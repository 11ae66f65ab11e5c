"""What the Scheduler reports without changing anything: prompt logprobs from a batch's logits, the status."""

from __future__ import annotations

from typing import Any

import torch

from radix.base import CacheStats, PrefixCache
from radix.disk_cache import DiskCacheStats
from radix.naive_cache import NaiveCache
from runtime.executor.sampler import Sampler
from runtime.scheduler.batch import StepBatch
from runtime.scheduler.policy import SchedulePolicy
from runtime.scheduler.stats import SchedulerStats


def record_prompt_logprobs(step: StepBatch, logits: torch.Tensor, sampler: Sampler, live: set[int]) -> None:
    """Append the prompt logprobs of the batch's plans ``live`` (indices) to their requests' buffers."""
    for i in live:
        req = step.plans[i].req
        if req.wants_prompt_logprobs and req.prompt_logprob_start == 0 and not req.first_input_logprob_added:
            # the first prompt token has no context, so no logprob (SGLang reports None)
            req.pending_input_logprobs.append((None, req.tokens[0]))
            req.pending_input_top.append(None)
            req.first_input_logprob_added = True
    for pr in step.prompt_rows:
        if pr.plan not in live:
            continue
        req = step.plans[pr.plan].req
        logp = sampler.log_softmax(logits[pr.rows[0] : pr.rows[-1] + 1])
        targets = torch.tensor([req.tokens[p + 1] for p in pr.positions])
        vals = logp.gather(1, targets[:, None]).squeeze(1).tolist()
        for j, p in enumerate(pr.positions):
            req.pending_input_logprobs.append((vals[j], req.tokens[p + 1]))
            if req.top_logprobs_num:
                tv, ti = torch.topk(logp[j], req.top_logprobs_num)
                req.pending_input_top.append(list(zip(tv.tolist(), ti.tolist())))


def status_report(cache: PrefixCache, stats: SchedulerStats, policy: SchedulePolicy, ratio: float,
                  num_running: int, num_waiting: int, kv: dict[str, int]) -> dict[str, Any]:
    """``Scheduler.server_info()``: queue sizes, KV accounting, cache and scheduler statistics."""
    cs = cache.stats()
    return {
        "num_running_reqs": num_running,
        "num_waiting_reqs": num_waiting,
        "kv": kv,
        "cache": {
            "enabled": not isinstance(cache, NaiveCache),
            "hit_tokens": cs.hit_tokens,
            "miss_tokens": cs.miss_tokens,
            "hit_rate": round(cs.hit_rate, 4),
            "cached_tokens": cs.cached_tokens,
            "num_nodes": cs.num_nodes,
            "evictable_size": cs.evictable_size,
            "protected_size": cs.protected_size,
            "evicted_tokens": cs.evicted_tokens,
            "eviction_policy": cache.eviction_policy,
            "page_size": cache.page_size,
            "tiers": tier_report(cs),
        },
        "scheduler": {**stats.as_dict(), "schedule_policy": policy.name, "queue_reorders": policy.reorders},
        "new_token_ratio": round(ratio, 4),
    }


def tier_report(cs: CacheStats) -> dict[str, Any]:
    """Hits and traffic per memory tier (``device`` only, unless the hierarchical cache is on; ``disk`` with
    its storage backend: hit tokens, blocks written/read, bytes, corrupted blocks, load time)."""
    out: dict[str, Any] = {"device": {"hit_tokens": cs.device_hit_tokens, "cached_tokens": cs.cached_tokens}}
    if cs.host_capacity:
        out["host"] = {"hit_tokens": cs.host_hit_tokens, "cached_tokens": cs.host_tokens,
                       "host_only_tokens": cs.host_only_tokens, "capacity": cs.host_capacity,
                       "dropped_tokens": cs.host_evicted_tokens, "bytes_to_host": cs.bytes_to_host,
                       "bytes_to_device": cs.bytes_to_device}
    if isinstance(cs, DiskCacheStats):
        out["disk"] = dict(cs.disk)
    return out
