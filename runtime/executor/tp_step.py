"""What rank 0 tells the other tensor-parallel ranks to do next, one operation at a time.

Every operation starts with a broadcast of a fixed header: the operation, then its sizes. The ranks run
the operations in the order rank 0 sends them (rank 0 sends each under one lock), so a copy between KV
tiers is ordered with the forward passes around it on every rank alike.

* ``FORWARD``: one step's batch (below), then the forward pass and the logits gather.
* ``KV_READ`` / ``KV_WRITE``: a copy between the device pool and the host or disk tier (``tp_kv.py``): one
  broadcast of the slots, then every rank's heads of those slots are gathered to rank 0 (read) or rank 0
  scatters each rank its heads (write).
* ``STOP``: the ranks exit.

A forward step is two broadcasts: the header, then one int64 tensor holding everything a rank needs to
rebuild the :class:`ForwardBatch` against its own KV shard and request table:

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

FORWARD, STOP, KV_READ, KV_WRITE = 1, 2, 3, 4
HEADER = 6  # the operation, then FORWARD: mode, T, B, L, table entries; KV_READ / KV_WRITE: slots


@dataclass
class StepData:
    """What a rank received: the batch (over its own KV) and which rows' logits rank 0 wants."""

    batch: ForwardBatch
    logit_rows: torch.Tensor


@dataclass
class KVCopy:
    """A copy between the device pool and a lower tier: every rank's heads of ``slots`` are gathered to rank
    0 (``write`` False) or scattered from it (``write`` True)."""

    write: bool
    slots: torch.Tensor


def send_step(comm: TPComm, batch: ForwardBatch, logit_rows: torch.Tensor) -> None:
    """Rank 0: broadcast the batch (and the logits rows) it is about to run."""
    dev = batch.input_ids.device
    rows = batch.req_pool_indices
    table = [batch.req_to_token[r, :n] for r, n in zip(rows.tolist(), batch.seq_lens_cpu)]
    parts = [batch.input_ids, batch.positions, batch.out_cache_loc, rows, batch.prefix_lens, batch.extend_lens,
             logit_rows.to(dev), *table]
    payload = torch.cat([p.to(torch.int64) for p in parts])
    mode = 1 if batch.mode is ForwardMode.DECODE else 0
    header = torch.tensor([FORWARD, mode, batch.num_tokens, batch.batch_size, logit_rows.numel(),
                           sum(batch.seq_lens_cpu)], dtype=torch.int64, device=dev)
    comm.broadcast_(header)
    comm.broadcast_(payload)


def send_kv_copy(comm: TPComm, copy: KVCopy, device: torch.device) -> None:
    """Rank 0: announce a copy of ``copy.slots`` (the gather or scatter follows, ``tp_kv.py``)."""
    slots = copy.slots.to(device, torch.int64)
    header = torch.tensor([KV_WRITE if copy.write else KV_READ, slots.numel(), 0, 0, 0, 0], dtype=torch.int64,
                          device=device)
    comm.broadcast_(header)
    comm.broadcast_(slots.contiguous())


def send_stop(comm: TPComm, device: torch.device) -> None:
    comm.broadcast_(torch.tensor([STOP, 0, 0, 0, 0, 0], dtype=torch.int64, device=device))


def recv_op(comm: TPComm, kv: KVStorage, req_to_token: torch.Tensor) -> StepData | KVCopy | None:
    """Ranks 1..N-1: the next operation, a forward step over ``kv`` or a KV copy (None: stop)."""
    dev = req_to_token.device
    header = comm.broadcast_(torch.zeros(HEADER, dtype=torch.int64, device=dev))
    op, *sizes = header.tolist()
    if op == STOP:
        return None
    if op in (KV_READ, KV_WRITE):
        slots = comm.broadcast_(torch.empty(sizes[0], dtype=torch.int64, device=dev))
        return KVCopy(op == KV_WRITE, slots)
    if op != FORWARD:
        raise RuntimeError(f"unknown tensor-parallel operation {op}")
    return _recv_step(comm, kv, req_to_token, *sizes)


def _recv_step(comm: TPComm, kv: KVStorage, req_to_token: torch.Tensor, mode: int, t: int, b: int, n_logits: int,
               n_table: int) -> StepData:
    """A forward step's batch over ``kv``. Writes the batch's page-table rows into ``req_to_token`` (the
    rank's mirror of rank 0's table)."""
    dev = req_to_token.device
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
