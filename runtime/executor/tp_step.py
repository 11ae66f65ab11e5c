"""One step's batch, broadcast from rank 0 to the other tensor-parallel ranks.

Two broadcasts per step: a fixed header (command and sizes), then one int64 tensor holding everything a
rank needs to rebuild the :class:`ForwardBatch` against its own KV shard and request table:

    input_ids[T] positions[T] out_cache_loc[T] req_pool_indices[B] prefix_lens[B] extend_lens[B]
    logit_rows[L] page-table rows (for each request, its first seq_len slots)

Only rank 0 runs the scheduler and owns the radix tree, the allocator and the authoritative request table;
the other ranks keep a mirror table into which every step writes the rows its batch reads. Whole rows are
sent (``sum(seq_lens)`` ids a step), not diffs: a prefix matched in the radix tree enters rank 0's table at
admission without a forward, so no rank could keep its mirror current from forward steps alone. At
decode that is the step's largest message; it is measured in docs/ARCHITECTURE.md's TP section.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radix.kv_storage import KVStorage
from runtime.core.forward_batch import ForwardBatch, ForwardMode
from runtime.distributed.comm import TPComm

RUN, STOP = 1, 2
HEADER = 6  # command, mode, T, B, L, table entries


@dataclass
class StepData:
    """What a rank received: the batch (over its own KV) and which rows' logits rank 0 wants."""

    batch: ForwardBatch
    logit_rows: torch.Tensor


def send_step(comm: TPComm, batch: ForwardBatch, logit_rows: torch.Tensor) -> None:
    """Rank 0: broadcast the batch (and the logits rows) it is about to run."""
    dev = batch.input_ids.device
    rows = batch.req_pool_indices
    table = [batch.req_to_token[r, :n] for r, n in zip(rows.tolist(), batch.seq_lens_cpu)]
    parts = [batch.input_ids, batch.positions, batch.out_cache_loc, rows, batch.prefix_lens, batch.extend_lens,
             logit_rows.to(dev), *table]
    payload = torch.cat([p.to(torch.int64) for p in parts])
    mode = 1 if batch.mode is ForwardMode.DECODE else 0
    header = torch.tensor([RUN, mode, batch.num_tokens, batch.batch_size, logit_rows.numel(),
                           sum(batch.seq_lens_cpu)], dtype=torch.int64, device=dev)
    comm.broadcast_(header)
    comm.broadcast_(payload)


def send_stop(comm: TPComm, device: torch.device) -> None:
    comm.broadcast_(torch.tensor([STOP, 0, 0, 0, 0, 0], dtype=torch.int64, device=device))


def recv_step(comm: TPComm, kv: KVStorage, req_to_token: torch.Tensor) -> StepData | None:
    """Ranks 1..N-1: the next step's batch over ``kv`` (None: stop). Writes the batch's page-table rows
    into ``req_to_token`` (the rank's mirror of rank 0's table)."""
    dev = req_to_token.device
    header = comm.broadcast_(torch.zeros(HEADER, dtype=torch.int64, device=dev))
    cmd, mode, t, b, n_logits, n_table = header.tolist()
    if cmd == STOP:
        return None
    payload = comm.broadcast_(torch.empty(3 * t + 3 * b + n_logits + n_table, dtype=torch.int64, device=dev))
    ids, positions, out_loc, rows, prefix, extend, logit_rows, table = torch.split(
        payload, [t, t, t, b, b, b, n_logits, n_table])
    prefix_cpu, extend_cpu = prefix.tolist(), extend.tolist()
    seq_cpu = [p + e for p, e in zip(prefix_cpu, extend_cpu)]
    at = 0
    for r, n in zip(rows.tolist(), seq_cpu):
        req_to_token[r, :n] = table[at:at + n]
        at += n
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if mode else ForwardMode.EXTEND,
        input_ids=ids, positions=positions, out_cache_loc=out_loc, req_pool_indices=rows,
        seq_lens=prefix + extend, prefix_lens=prefix, extend_lens=extend,
        seq_lens_cpu=seq_cpu, prefix_lens_cpu=prefix_cpu, extend_lens_cpu=extend_cpu,
        kv=kv, req_to_token=req_to_token)
    return StepData(batch, logit_rows)
