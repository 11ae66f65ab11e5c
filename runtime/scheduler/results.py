"""What the Scheduler reports without changing anything: prompt logprobs from a batch's logits, the status.

``live_status`` computes the live figures once (``Scheduler.status()``): the scheduler loop pushes them for
/metrics and routers, the dashboard's live figures are them, and ``status_report`` (/get_server_info) adds
its checked KV accounting and the details on top."""

from __future__ import annotations

import logging
from typing import Any

import torch

from radix.base import CacheStats, PrefixCache
from radix.disk_cache import DiskCacheStats
from radix.naive_cache import NaiveCache
from runtime.core.messages import SchedulerStatus
from runtime.executor.sampler import Sampler
from runtime.scheduler.admission import PrefillPlan
from runtime.scheduler.batch import StepBatch
from runtime.scheduler.policy import SchedulePolicy
from runtime.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)


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


def live_status(cache: PrefixCache, stats: SchedulerStats, num_running: int, num_waiting: int) -> SchedulerStatus:
    """The live figures of ``Scheduler.status()``: counters only (no integrity check), cheap enough for every
    half second."""
    cap = cache.allocator.capacity
    cs = cache.stats()
    return SchedulerStatus(
        num_running=num_running,
        num_waiting=num_waiting,
        token_usage=round(1 - cache.available_size / cap, 4),
        cache_hit_rate=round(cs.hit_rate, 4),
        decode_throughput=round(stats.decode_throughput(), 2),
        cached_tokens=cs.cached_tokens,
        capacity=cap,
        forward_steps=stats.steps,
        kv_free=cache.allocator.free_size,
        kv_evictable=cache.evictable_size,
        kv_protected=cache.protected_size,
        hit_tokens=cs.hit_tokens,
        miss_tokens=cs.miss_tokens,
        cache_nodes=cs.num_nodes,
        evicted_tokens=cs.evicted_tokens,
        prefill_tokens=stats.prefill_tokens,
        decode_tokens=stats.decode_tokens,
        forward_seconds=stats.forward_seconds,
        finished_requests=stats.finished,
        tiers=tier_report(cs),
        spec_verifications=stats.spec_verifications,
        spec_draft_tokens=stats.spec_draft_tokens,
        spec_accepted_tokens=stats.spec_accepted_tokens,
    )


def step_log_enabled() -> bool:
    """Whether ``log_step`` writes anything (the status it reads is not computed otherwise)."""
    return logger.isEnabledFor(logging.INFO)


def log_step(status: SchedulerStatus, prefills: list[PrefillPlan], decodes: int) -> None:
    """A step's log line, its figures read from ``status`` (``Scheduler.status()``)."""
    if prefills:
        logger.info("prefill: %d seqs, %d new tokens, cache hit rate %.1f%%, %d running, %d queued", len(prefills),
                    sum(p.extend for p in prefills), 100 * status.cache_hit_rate, status.num_running,
                    status.num_waiting)
    elif decodes:
        logger.info("decode: %d running, %d queued, %.1f tokens/s, KV usage %.1f%%", decodes, status.num_waiting,
                    status.decode_throughput, 100 * status.token_usage)


def status_report(status: SchedulerStatus, cache: PrefixCache, stats: SchedulerStats, policy: SchedulePolicy,
                  ratio: float, kv: dict[str, int]) -> dict[str, Any]:
    """``Scheduler.server_info()``: the live ``status`` with the checked KV accounting ``kv``, the cache's
    settings and every scheduler counter."""
    return {
        "num_running_reqs": status.num_running,
        "num_waiting_reqs": status.num_waiting,
        "kv": kv,
        "cache": {
            "enabled": not isinstance(cache, NaiveCache),
            "hit_tokens": status.hit_tokens,
            "miss_tokens": status.miss_tokens,
            "hit_rate": status.cache_hit_rate,
            "cached_tokens": status.cached_tokens,
            "num_nodes": status.cache_nodes,
            "evictable_size": status.kv_evictable,
            "protected_size": status.kv_protected,
            "evicted_tokens": status.evicted_tokens,
            "eviction_policy": cache.eviction_policy,
            "page_size": cache.page_size,
            "tiers": status.tiers,
        },
        "scheduler": {**stats.as_dict(), "schedule_policy": policy.name, "queue_reorders": policy.reorders},
        "new_token_ratio": round(ratio, 4),
    }


def tier_report(cs: CacheStats) -> dict[str, Any]:
    """Hits and traffic per memory tier: ``device`` always, ``host`` with the hierarchical cache, ``disk`` with
    its storage backend. Every tier has ``hit_tokens`` (recorded hits served from that tier: the three add up
    to the cache's ``hit_tokens``) and ``cached_tokens`` (tokens whose KV the tier holds); the lower tiers add
    ``bytes_written`` (copied into the tier), ``bytes_read`` (copied out of it, to the device), ``loads`` and
    ``load_seconds`` (admissions that loaded from the tier, and how long they waited for it) and their own
    details (the host's capacity and drops, the disk's blocks, corruption, write errors, directory)."""

    def _load_figures(loads: int, seconds: float) -> dict[str, Any]:
        return {"loads": loads, "load_seconds": round(seconds, 6), "load_ms": round(1e3 * seconds, 3),
                "mean_load_ms": round(1e3 * seconds / loads, 3) if loads else 0.0}

    out: dict[str, Any] = {"device": {"hit_tokens": cs.device_hit_tokens, "cached_tokens": cs.cached_tokens,
                                      "evicted_tokens": cs.evicted_tokens}}
    if cs.host_capacity:
        out["host"] = {"hit_tokens": cs.host_hit_tokens, "cached_tokens": cs.host_tokens,
                       "host_only_tokens": cs.host_only_tokens, "capacity": cs.host_capacity,
                       "dropped_tokens": cs.host_evicted_tokens,
                       "bytes_written": cs.bytes_to_host, "bytes_read": cs.bytes_to_device,
                       "bytes_to_host": cs.bytes_to_host, "bytes_to_device": cs.bytes_to_device,
                       **_load_figures(cs.host_loads, cs.host_load_seconds)}
    if isinstance(cs, DiskCacheStats):
        disk = dict(cs.disk)
        # the tier's own count is every load's tokens; a hit is what a recorded lookup took (radix.tier_stats)
        disk["loaded_tokens"] = disk.pop("hit_tokens", 0)
        disk["hit_tokens"] = cs.disk_hit_tokens
        disk["cached_tokens"] = disk.get("blocks_stored", 0) * disk.get("block_tokens", 0)
        out["disk"] = {**disk, **_load_figures(cs.disk_loads, cs.disk_load_seconds)}
    return out
