"""The same greedy tokens whatever the cache, chunking, page size or memory pressure (up to float near-ties,
see tests/oracle.py); each configuration's flags visibly at work; and the scheduler's sharing, abort and
accounting behaviour."""

from __future__ import annotations

import random
import threading
import time

import pytest

from runtime.config import ServerArgs
from runtime.core.errors import IntakeError
from runtime.core.messages import TokenizedRequest
from runtime.core.sampling_params import SamplingParams
from runtime.executor.model_runner import ModelRunner
from runtime.models.folders import load_tokenizer
from runtime.models.tokenizer import eos_token_ids
from runtime.scheduler.scheduler import Scheduler
from tests.oracle import WITH_TOP2, assert_all_agree

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """Eight prompts: two families sharing long prefixes, one with a shorter shared part, one alone."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 49000) for _ in range(n)]

    base_a, base_b = toks(90), toks(70)
    out = [base_a + toks(k) for k in (5, 12, 30)]
    out += [base_b + toks(k) for k in (1, 20)]
    out += [base_a[:40] + toks(25), toks(50), base_a + toks(5)[:3]]
    return out


def run(engine, prompts, params=GREEDY):
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


def run_top2(engine, prompts, params=GREEDY):
    """Native results with logprobs and the top-2 at each step (what tests/oracle.py compares)."""
    return engine.generate(input_ids=prompts, sampling_params=params, **WITH_TOP2)


CONFIGS = {
    "radix": {},
    "no-radix": {"disable_radix_cache": True},
    "chunked-16": {"chunked_prefill_size": 16},
    "no-chunking": {"chunked_prefill_size": -1},
    "page-16": {"page_size": 16, "chunked_prefill_size": 32},
    # a pool small enough that cached prefixes must be evicted (and a request retracted)
    "page-4-lfu-fcfs": {"page_size": 4, "eviction_policy": "lfu", "schedule_policy": "fcfs", "max_total_tokens": 384},
    "tiny-pool-retraction": {"max_total_tokens": 320, "schedule_conservativeness": 0.01},
}


# The oracle's tolerances are calibrated for float32 (tests/oracle.py); pinned, whatever the device's default.
FP32 = {"dtype": "float32"}


def check_flags_at_work(name: str, info: dict) -> None:
    """What each configuration changes really happened (equal tokens alone would pass with the flags ignored).
    The policy names come from the live objects (the scheduler's policy, the cache's eviction index)."""
    sched, cache = info["scheduler"], info["cache"]
    policy = "fcfs" if name == "page-4-lfu-fcfs" else "lpm"
    assert sched["schedule_policy"] == policy, (name, sched)
    assert cache["eviction_policy"] == {"no-radix": None, "page-4-lfu-fcfs": "lfu"}.get(name, "lru"), (name, cache)
    assert cache["page_size"] == {"page-16": 16, "page-4-lfu-fcfs": 4}.get(name, 1), (name, cache)
    assert (cache["hit_tokens"] > 0) == (name != "no-radix"), (name, cache)
    if name == "radix":  # this workload makes LPM reorder the queue, so FCFS's zero below means something
        assert sched["queue_reorders"] > 0, sched
    if name == "page-4-lfu-fcfs":
        assert sched["queue_reorders"] == 0, sched
        assert cache["evicted_tokens"] > 0, cache
    if name == "chunked-16":  # prompts of 50 to 120 tokens went in chunks of at most 16
        assert sched["prefill_chunks"] >= 6 and sched["max_step_prefill_tokens"] <= 16, sched
    if name == "page-16":
        assert sched["prefill_chunks"] > 0 and sched["max_step_prefill_tokens"] <= 32, sched
    if name in ("radix", "no-chunking"):  # the default 1024 (and no limit) never split these prompts
        assert sched["prefill_chunks"] == 0 and sched["max_step_prefill_tokens"] > 16, sched
    if name == "tiny-pool-retraction":
        assert sched["retractions"] > 0, "the small pool must force retraction"


def test_greedy_tokens_identical_across_configurations(tiny_engine):
    prompts = shared_prefix_prompts()
    reference = run_top2(tiny_engine(**FP32), prompts)
    # a second pass over a warm cache gives the same tokens too
    warm = tiny_engine(**FP32)
    run(warm, prompts)
    assert_all_agree(reference, run_top2(warm, prompts), "warm cache")
    for name, options in CONFIGS.items():
        engine = tiny_engine(**FP32, **options)
        assert_all_agree(reference, run_top2(engine, prompts), name)
        check_flags_at_work(name, engine.server_info())


def test_requests_one_by_one_equal_the_batch(tiny_engine):
    prompts = shared_prefix_prompts(1)
    engine = tiny_engine(**FP32)
    batch = run_top2(engine, prompts)
    alone = tiny_engine(disable_radix_cache=True, **FP32)
    assert_all_agree(batch, [run_top2(alone, [p])[0] for p in prompts], "one by one")


def test_second_request_reports_cached_prefix(tiny_engine):
    engine = tiny_engine()
    first = list(range(1000, 1100))
    out = engine.generate(input_ids=first, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert out["meta_info"]["cached_tokens"] == 0
    second = first[:80] + list(range(5000, 5030))
    out = engine.generate(input_ids=second, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert out["meta_info"]["cached_tokens"] == 80
    assert out["meta_info"]["prompt_tokens"] == 110
    # the whole previous turn (prompt + answer) is cached for the next turn of a chat
    turn = engine.generate(input_ids=second, sampling_params={"max_new_tokens": 6, "temperature": 0})
    nxt = second + turn["output_ids"] + [42, 43]
    out = engine.generate(input_ids=nxt, sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert out["meta_info"]["cached_tokens"] >= len(second) + len(turn["output_ids"]) - 1


def test_n_samples_prefill_the_prompt_once(tiny_engine):
    engine = tiny_engine()
    prompt = list(range(2000, 2200))
    before = engine.server_info()["scheduler"]["prefill_tokens"]
    outs = engine.generate(input_ids=prompt, sampling_params={"n": 4, "max_new_tokens": 6, "temperature": 1.0,
                                                              "seed": 7})
    computed = engine.server_info()["scheduler"]["prefill_tokens"] - before
    assert len(outs) == 4
    assert computed == len(prompt) + 3, "each extra sample recomputes only the last prompt token"
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0, 199, 199, 199]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "different samples"


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny_engine):
    engine = tiny_engine()
    shared = list(range(3000, 3300))
    prompts = [shared + [i, i + 1, i + 2] for i in range(6)]
    before = engine.server_info()["scheduler"]["prefill_tokens"]
    run(engine, prompts, {"max_new_tokens": 2, "temperature": 0})
    computed = engine.server_info()["scheduler"]["prefill_tokens"] - before
    assert computed == 300 + 6 * 3


def test_abort_from_queue_and_running_batch(tiny_engine):
    engine = tiny_engine(max_running_requests=1)
    results: dict[str, dict] = {}

    def go(rid: str, n: int) -> None:
        results[rid] = engine.generate(input_ids=list(range(10, 60)), rid=rid,
                                       sampling_params={"max_new_tokens": n, "ignore_eos": True})

    threads = [threading.Thread(target=go, args=("long", 4000)), threading.Thread(target=go, args=("queued", 5))]
    threads[0].start()
    deadline = time.time() + 30
    while engine.server_info()["num_running_reqs"] == 0 and time.time() < deadline:
        time.sleep(0.01)
    threads[1].start()
    while engine.server_info()["num_waiting_reqs"] == 0 and time.time() < deadline:
        time.sleep(0.01)
    engine.abort("queued")
    threads[1].join(10)
    assert results["queued"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert results["queued"]["meta_info"]["completion_tokens"] == 0
    engine.abort("long")
    threads[0].join(10)
    assert results["long"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < results["long"]["meta_info"]["completion_tokens"] < 4000
    report = engine.check_integrity()
    assert report["private"] == 0 and report["protected"] == 0


def test_stream_abandoned_midway_frees_its_kv(tiny_engine):
    engine = tiny_engine()
    stream = engine.generate(input_ids=list(range(10, 40)), stream=True,
                             sampling_params={"max_new_tokens": 4000, "ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the caller walked away: the request is aborted
    deadline = time.time() + 10
    while engine.server_info()["num_running_reqs"] and time.time() < deadline:
        time.sleep(0.01)
    assert engine.server_info()["kv"]["private"] == 0


def test_flush_cache(tiny_engine):
    engine = tiny_engine()
    run(engine, shared_prefix_prompts()[:2])
    assert engine.server_info()["cache"]["cached_tokens"] > 0
    assert engine.flush_cache()
    info = engine.server_info()
    assert info["cache"]["cached_tokens"] == 0 and info["kv"]["free"] == info["kv"]["capacity"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_larger_than_pool_is_refused(tiny_engine, page_size):
    """The intake refuses it before anything is queued, and the engine serves on."""
    engine = tiny_engine(max_total_tokens=64, page_size=page_size, chunked_prefill_size=32)
    with pytest.raises(IntakeError, match="pool") as err:
        engine.generate(input_ids=list(range(100, 200)), sampling_params={"max_new_tokens": 2})
    assert err.value.field == "input_ids"
    out = engine.generate(input_ids=list(range(100, 110)), sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_the_scheduler_asserts_what_the_intake_refuses(tiny_model_dir):
    """The intake is the one place that refuses a request that cannot run: the scheduler states the same rule
    (``length_refusal``) as an assertion, so a request that skipped the intake is a caller's bug, found at once
    and before it touches the pool."""
    args = ServerArgs(model=str(tiny_model_dir), max_total_tokens=64, log_level="warning").resolve()
    runner = ModelRunner(args)
    tok = load_tokenizer(runner.model_path)
    sched = Scheduler(args, runner, tok, eos_token_ids(tok, runner.hf_config, runner.model_path))
    with pytest.raises(AssertionError, match=r"skipped the intake.*pool"):
        sched.submit(TokenizedRequest("big", list(range(100, 200)), SamplingParams(max_new_tokens=2)))
    assert sched.idle and sched.check_integrity()["private"] == 0
    sched.close()
