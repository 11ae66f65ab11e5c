"""The parts of n-gram speculation that need no model: drafting, the adaptive draft length, the acceptance rule,
and freeing the KV of rejected positions under the allocator's page rule."""

from __future__ import annotations

from array import array

import pytest
import torch

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.radix_cache import RadixCache
from runtime.core.sampling_params import SamplingParams
from runtime.executor.sampling_batch import SamplingBatch
from runtime.scheduler.speculation import release_tail
from runtime.speculative.adaptive import MAX_PAUSE, DraftLength
from runtime.speculative.ngram import NgramConfig, NgramDrafter, Occurrence, choose_draft, own_occurrences
from runtime.speculative.verify import accepted_length, verify_rows

CFG = NgramConfig(num_draft_tokens=4, min_match=2, max_match=6, capacity=1000)


def toks(*ids: int) -> array:
    return array("i", ids)


def test_own_suffix_drafts_what_followed_it():
    d = NgramDrafter(CFG)
    assert d.propose(toks(5, 6, 7, 8, 9, 5, 6), None, 3) == [7, 8, 9]
    assert d.propose(toks(5, 6, 7, 8, 9, 5, 6), None, 10) == [7, 8, 9, 5, 6]  # up to the end of the sequence
    assert d.propose(toks(1, 2, 3, 4), None, 4) == []  # the suffix occurs nowhere else
    assert d.propose(toks(5, 6), None, 4) == []


def test_longest_match_wins_then_most_frequent():
    # "2 3" occurs after 9 (-> 40) and after 1 (-> 50, twice); the suffix is "1 2 3": the longer match wins
    seq = toks(9, 2, 3, 40, 1, 2, 3, 50, 7, 1, 2, 3, 50, 8, 1, 2, 3)
    assert [(o.match, o.start) for o in own_occurrences(seq, CFG)] == [(3, 12), (3, 7), (2, 3)]  # latest first
    assert NgramDrafter(CFG).propose(seq, None, 1) == [50]
    # equal match lengths: the continuation most occurrences agree on
    occ = [Occurrence(2, [1, 2, 10, 11], 2), Occurrence(2, [1, 2, 20, 21], 2), Occurrence(2, [1, 2, 20, 22], 2)]
    assert choose_draft(occ, 2) == [20, 21]  # 20 by two votes to one, then the tie goes to the first seen
    assert choose_draft(occ[:1] + [Occurrence(3, [0, 1, 2, 30], 3)], 2) == [30]


def test_misaligned_byte_matches_are_not_token_matches():
    # 0x00000100, 0x00000001 contains the bytes of (1, 0) shifted; only whole tokens may match
    seq = toks(256, 1, 7, 1, 0)
    assert NgramDrafter(CFG).propose(seq, None, 2) == []


def test_finished_sequences_draft_in_their_namespace_only():
    d = NgramDrafter(CFG)
    d.remember(toks(11, 12, 13, 14, 15, 16), "a")
    assert d.propose(toks(1, 12, 13), "a", 3) == [14, 15, 16]
    assert d.propose(toks(1, 12, 13), None, 3) == []
    assert d.propose(toks(1, 12, 13), "b", 3) == []
    d.clear()
    assert d.propose(toks(1, 12, 13), "a", 3) == []


def test_store_capacity_drops_the_oldest_sequences_and_their_index():
    d = NgramDrafter(NgramConfig(min_match=2, capacity=10))
    d.remember(toks(1, 2, 3, 4, 5, 6), None)
    d.remember(toks(7, 8, 9, 10, 11, 12), None)  # 12 tokens > 10: the first goes
    assert d.store.tokens == 6 and len(d.store) == 1
    assert d.propose(toks(0, 2, 3), None, 2) == []
    assert d.propose(toks(0, 8, 9), None, 2) == [10, 11]


def test_a_large_store_still_drafts_the_continuation_it_holds():
    """A store of 200 finished 1,000-token sequences (what a proposal costs against it is measured by
    benchmarks/bench_speculative.py): a request ending in a suffix that one stored sequence holds gets that
    sequence's continuation, and a suffix found nowhere gets no draft."""
    g = torch.Generator().manual_seed(0)
    d = NgramDrafter(NgramConfig(capacity=1 << 20))
    seqs = [array("i", torch.randint(0, 500, (1000,), generator=g).tolist()) for _ in range(200)]
    for seq in seqs:
        d.remember(seq, None)
    target = seqs[123]
    mine = array("i", [600, 601, 602, *target[400:408]])  # 8 tokens that sequence 123 continues with 408..
    assert list(d.propose(mine, None, 4)) == list(target[408:412])
    assert not d.propose(array("i", [700, 701, 702, 703]), None, 4)  # tokens no sequence holds


def test_adaptive_length_backs_off_and_recovers():
    s = DraftLength(8)
    assert s.want() == 8
    s.update(8, 8)
    assert s.k == 8
    s.update(8, 2)
    assert s.k == 3
    s.update(3, 0)
    assert s.k == 1 and s.pause == 0
    s.update(1, 0)  # the second full rejection in a row pauses drafting
    assert s.pause == 2 and [s.want() for _ in range(3)] == [0, 0, 1]
    for _ in range(10):
        s.update(1, 0)
    assert s.pause == MAX_PAUSE
    s.pause = 0
    s.update(1, 1)
    assert s.k == 2 and s.misses == 0
    assert (s.drafted, s.accepted) == (8 + 8 + 3 + 1 + 10 + 1, 8 + 2 + 1)


def test_acceptance_is_the_agreeing_prefix():
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_length([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_length([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted_length([], [4]) == 0


class _Row:
    def __init__(self, sp: SamplingParams, output: list[int]):
        self.sampling, self.seed, self.output_ids, self.input_ids = sp, 7, output, [1, 2]
        self.eos_ids, self.return_logprob, self.top_logprobs_num, self.grammar = frozenset({2}), True, 0, None


def test_verify_rows_sample_each_position_as_a_decode_there_would():
    sp = SamplingParams.from_dict({"temperature": 0.8, "frequency_penalty": 0.5, "min_new_tokens": 2, "seed": 7})
    req = _Row(sp, [30])
    rows = verify_rows(req, [40, 50])
    assert [list(r.output_ids) for r in rows] == [[30], [30, 40], [30, 40, 50]]
    spec = SamplingBatch.build(rows, 100)
    plain = SamplingBatch.build([_Row(sp, [30]), _Row(sp, [30, 40]), _Row(sp, [30, 40, 50])], 100)
    for name in ("uniform", "temperature", "greedy"):
        assert torch.equal(getattr(spec, name), getattr(plain, name))
    assert torch.equal(spec.output_penalty.values, plain.output_penalty.values)
    assert spec.banned.rows.tolist() == plain.banned.rows.tolist() == [0]  # min_new_tokens: only position 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_release_tail_frees_whole_pages_past_the_kept_positions(page_size):
    alloc = PagedAllocator(64, page_size)
    cache = RadixCache(alloc, ReqToTokenPool(4, 64))
    state = cache.new_request()
    cache.alloc_tokens(state, 6)  # 5 kept + 1
    before = alloc.free_size
    cache.alloc_tokens(state, 5)  # a draft's slots
    release_tail(cache, state, 7)  # two accepted
    assert state.kv_len == 7
    assert alloc.free_size == before - (alloc.pages_for(7) - alloc.pages_for(6)) * page_size
    report = cache.check_integrity([state])
    assert report["private"] == alloc.pages_for(7) * page_size
    cache.alloc_tokens(state, 3)  # the partly used page continues where the kept positions end
    assert torch.equal(cache.req_to_token.read(state.row, 0, 10) % page_size, torch.arange(10) % page_size)
    cache.release_req(state)
    assert cache.check_integrity()["free"] == 64
