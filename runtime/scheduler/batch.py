"""From a step's plans to a ForwardBatch, and which logits rows each request needs back.

Decodes are plans with ``extend == 1``; prefill chunks have larger extends. Every plan's KV slots are
already allocated (``req.kv_len`` counts them), so the new tokens of a plan are
``req.tokens[kv_len - extend : kv_len]`` — except for a decode verifying a speculative draft
(``plan.draft``, ``runtime.scheduler.speculation``): its last real token then the draft, with a logits row at
each of those ``1 + len(draft)`` positions (``sample_rows`` names the first) — and for a request that is
*ahead* (overlap loop): its one
new token is being sampled by the batch still in flight, so its row of ``input_ids`` is left 0 and named in
``fill_positions`` / ``fill_rows``; the worker copies the token there from its device-side next-token table
(``runtime.executor.worker``) right before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.core.forward_batch import ForwardBatch, build_forward_batch
from runtime.executor.model_runner import ModelRunner
from runtime.scheduler.admission import PrefillPlan


@dataclass
class PromptLogprobRows:
    plan: int  # index into plans
    positions: list[int]  # prompt position p whose logits give the logprob of token p + 1
    rows: list[int]  # rows of the logits tensor holding them


@dataclass
class StepBatch:
    plans: list[PrefillPlan]
    forward: ForwardBatch
    logit_rows: torch.Tensor
    sample_rows: dict[int, int] = field(default_factory=dict)  # plan index -> (first) logits row sampled
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    fill_positions: list[int] = field(default_factory=list)  # input_ids rows filled on the device ...
    fill_rows: list[int] = field(default_factory=list)  # ... from the next-token table at these table rows


def build_step(plans: list[PrefillPlan], runner: ModelRunner, ahead: frozenset[int] = frozenset()) -> StepBatch:
    """``ahead``: ``id()`` of the requests whose input token the batch in flight is still sampling."""
    input_ids: list[list[int]] = []
    prefix_lens: list[int] = []
    rows: list[int] = []
    token_rows: list[int] = []
    token_pos: list[int] = []
    logit_rows: list[int] = []
    sample_rows: dict[int, int] = {}
    prompt_rows: list[PromptLogprobRows] = []
    fill_positions: list[int] = []
    fill_rows: list[int] = []
    offset = 0
    for i, plan in enumerate(plans):
        req = plan.req
        assert req.kv is not None
        end = req.kv_len
        start = end - plan.extend
        if id(req) in ahead:
            assert plan.extend == 1 and len(req.tokens) == start, "an ahead request decodes its next token"
            input_ids.append([0])
            fill_positions.append(offset)
            fill_rows.append(req.kv.row)
        else:
            input_ids.append(req.tokens[start : end - len(plan.draft)].tolist() + plan.draft)
        prefix_lens.append(start)
        rows.append(req.kv.row)
        token_rows.extend([req.kv.row] * plan.extend)
        token_pos.extend(range(start, end))
        if req.wants_prompt_logprobs:
            lo = max(start, req.prompt_logprob_start - 1, 0)
            hi = min(end, len(req.input_ids) - 1)  # the last prompt position predicts the first output
            if hi > lo:
                positions = list(range(lo, hi))
                prompt_rows.append(PromptLogprobRows(
                    i, positions, list(range(len(logit_rows), len(logit_rows) + len(positions)))))
                logit_rows.extend(offset + p - start for p in positions)
        if end >= req.fill_len:  # (an ahead request's fill_len lags one behind: it samples too)
            sample_rows[i] = len(logit_rows)
            logit_rows.extend(range(offset + plan.extend - 1 - len(plan.draft), offset + plan.extend))
        offset += plan.extend
    table = runner.req_to_token.table
    out_cache_loc = table[torch.tensor(token_rows), torch.tensor(token_pos)]
    fb = build_forward_batch(input_ids, prefix_lens, rows, out_cache_loc, runner.kv, table, runner.device,
                             runner.allocator)
    return StepBatch(plans, fb, torch.tensor(logit_rows, dtype=torch.int64), sample_rows, prompt_rows,
                     fill_positions, fill_rows)


def snapshot_table(fb: ForwardBatch) -> None:
    """Give a batch its own copy of its rows of the request-to-token table: the scheduler keeps writing the
    table (later batches' slots, cache inserts rewriting rows) while the batch is in flight."""
    width = max(fb.seq_lens_cpu, default=0) + 1
    fb.req_to_token = fb.req_to_token.index_select(0, fb.req_pool_indices)[:, :width].contiguous()
    fb.req_pool_indices = torch.arange(fb.batch_size, dtype=torch.int64, device=fb.req_pool_indices.device)
