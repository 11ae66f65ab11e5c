"""Planning for the torch-native attention backend: which requests are decode rows, prefill chunks or cascade
groups, and the slot-index tensors and masks each part reads (built once per batch, used by every layer).
The module docstring of ``torch_native.py`` explains the shapes of work."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.attention.cascade import SharedPrefix, SharedPrefixFinder
from runtime.core.forward_batch import ForwardBatch, ForwardMode

# Additive float masks measured ~15% faster than bool ones in the CPU SDPA kernel; above this many
# entries (a long chunk over a long prefix) memory wins and the mask is bool.
_FLOAT_MASK_LIMIT = 1 << 24
# A cascade plan whose prefill chunks' own parts (KV past the shared prefix) are all at most this long attends every
# row's own part, decode rows' and chunk tokens', in one call of the in-place kernel (``OwnRows``) instead of one call
# per chunk and one for the decode rows: 7 few-shot questions after their shared block spent 21 ms of a 200 ms
# prefill step in 210 calls, 11 ms in 30. The same table is what the native decode stack reads for such a batch.
OWN_CHUNKS_MAX = 64
# A cascade group shares a prefix kept packed from an earlier batch instead of its own longest one when that is at most
# this many positions longer (``_onto_kept``): they are attended in the members' own parts, as the question's tokens.
KEPT_SLACK = 16


@dataclass
class DecodeGroup:
    """Requests that add one token each, attended together."""

    kv_index: torch.Tensor  # [B * L] pool slots, request-major; padding -> slot 0
    batch_size: int
    max_len: int
    mask: torch.Tensor | None  # [B, 1, 1, L] additive (0 / -inf); None when all lengths are equal
    token_rows: torch.Tensor | None  # rows of these tokens in the batch; None = all rows, in order
    lengths: torch.Tensor | None = None  # [B] KV positions of each request (for the in-place kernel)


@dataclass
class PrefillChunk:
    """One request adding ``end - start`` tokens after ``prefix_len`` cached ones."""

    start: int  # first row of its new tokens in the batch
    end: int
    kv_index: torch.Tensor  # [S] pool slots of positions 0 .. S-1 (S = prefix + new)
    mask: torch.Tensor | None  # [E, S] causal-with-prefix mask (additive, or bool when huge); None = causal


@dataclass
class SharedPart:
    """One cascade group's shared prefix, attended by the cascade rows ``start .. end - 1``."""

    start: int
    end: int
    prefix_len: int  # P
    slots: torch.Tensor  # [P] pool slots of the prefix (what kernels reading the pool in place walk)
    kv_start: int | None = None  # set when the slots are the contiguous run kv_start .. + P - 1 (no gather)
    # Names this prefix's KV across batches (kernels may keep work derived from it under the key): the same key
    # means the same slots holding the same KV — the key is the slots themselves and how often their pages were
    # freed (``ForwardBatch.kv_history``), so requests coming and going elsewhere in the pool leave it unchanged.
    # None: nothing is kept (the history is unknown, or the slots live on another device).
    reuse_key: tuple[int, bytes] | None = None


@dataclass(frozen=True)
class KeptPrefix:
    """A shared prefix of an earlier batch whose packed KV a kernel keeps: its length and `SharedPart.reuse_key`."""

    length: int
    key: tuple[int, bytes]


@dataclass
class OwnRows:
    """The own part of every cascade row as one call of the in-place kernel (``PagedDecodeKernel.run``): cascade row
    t attends ``table[member[t], :lengths[t]]``, its request's KV past the group's shared prefix (a decode row all of
    it, a prefill token up to itself)."""

    table: torch.Tensor  # [M, W] each group member's own KV slots (positions P ..), padded with slot 0
    member: torch.Tensor  # [T] the row of ``table`` each cascade row reads
    lengths: torch.Tensor  # [T] own positions each cascade row attends


@dataclass
class CascadePlan:
    """All cascade groups of a batch. Their tokens ("cascade rows") are ordered group after group, so a
    group's queries and each of its prefill chunks are contiguous slices."""

    rows: torch.Tensor | None  # batch token row of each cascade row; None = all batch rows, in order
    num_rows: int
    shared: list[SharedPart]
    # Each member's own part (KV positions P .. seq_len - 1). Rows/starts index the cascade rows.
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    # every row's own part in one call, where the plan has prefill chunks and their own parts are short
    # (OWN_CHUNKS_MAX); None: the decode rows in one call and the chunks one by one
    own: OwnRows | None = None
    groups: list[SharedPrefix] = field(default_factory=list)  # what was planned: the groups after _onto_kept


@dataclass
class TorchNativeMetadata:
    decode: DecodeGroup | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    cascade: CascadePlan | None = None


def plan_batch(batch: ForwardBatch, cascade: SharedPrefixFinder | None,
               kept: Sequence[KeptPrefix] = (), previous: TorchNativeMetadata | None = None) -> None:
    """Build the slot-index tensors and masks once per batch (Python work per request, not per layer);
    ``cascade`` groups the requests that share a cached prefix (None: no groups); ``kept``: prefixes whose packed
    KV a kernel keeps from an earlier batch (see :func:`_onto_kept`); ``previous``: the plan of the batch before this
    one, made with the same ``kept`` (None: none such).

    A decode wave's step (the finder carried the previous decode batch's groups over) takes that plan's groups and
    shared parts as they are and plans only the rows' own parts, which grew by a token: the groups after
    ``_onto_kept`` depend only on the finder's groups, ``kept`` and the prefixes' slots, and the running requests
    hold those slots, so their KV, and with it each shared part's reuse key, did not change. Planning a batch-8
    few-shot decode step took 0.42 ms before, 0.28 ms this way."""
    if batch.batch_size == 0:
        batch.attn_metadata = TorchNativeMetadata()
        return
    groups: list[SharedPrefix] = []
    shared: list[SharedPart] | None = None
    if cascade is not None:
        groups = cascade.find(batch.req_to_token, batch.req_pool_indices.tolist(), batch.prefix_lens_cpu,
                              batch.mode is ForwardMode.DECODE)
        last = previous.cascade if previous is not None else None
        if cascade.carried and last is not None and not last.prefills:
            groups, shared = last.groups, last.shared
        elif kept:
            groups = _onto_kept(batch, groups, kept)
    dtype = batch.kv.shape.dtype
    if not groups and batch.mode is ForwardMode.DECODE:
        batch.attn_metadata = TorchNativeMetadata(decode=_decode_group(batch, None, None, dtype))
        return
    starts = [0]
    for ext in batch.extend_lens_cpu:
        starts.append(starts[-1] + ext)
    grouped = {i for g in groups for i in g.members}
    meta = TorchNativeMetadata()
    single: list[int] = []
    for i, (pre, ext) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
        if i in grouped:
            continue
        if ext == 1:
            single.append(i)
        elif ext > 1:
            meta.prefills.append(_prefill_chunk(batch, i, starts[i], pre, ext, dtype))
    if single:
        meta.decode = _decode_group(batch, single, None, dtype, [starts[i] for i in single],
                                         batch.num_tokens)
    if groups:
        meta.cascade = _cascade_plan(batch, groups, starts, dtype, shared)
    batch.attn_metadata = meta


def _onto_kept(batch: ForwardBatch, groups: list[SharedPrefix], kept: Sequence[KeptPrefix]) -> list[SharedPrefix]:
    """``groups`` moved onto the prefixes whose packed KV a kernel keeps from an earlier batch (``kept``).

    - A group whose prefix extends a kept one by at most ``KEPT_SLACK`` positions shares the kept one instead: a
      few-shot wave's questions may share the block plus a token one wave and the block alone the next, and each new
      length packed the block again in every layer (the extra positions are attended in the members' own parts).
    - A prompt outside every group whose cached prefix starts with a kept one becomes a group of one over it: behind a
      server a wave's first question often arrives alone, after the last wave's decode steps packed its block. As a
      plain prefill chunk it packed all its KV again in every layer, and its plan, sharing nothing, let the kept packs
      go, so the wave's next step packed the block once more. A batch of only such groups runs in the native decode
      stack.

    The key check is exact: the same slots, whose pages were not freed since the packs were made, hold the same KV."""
    rows = batch.req_pool_indices.tolist()

    def kept_under(i: int, longest: int) -> int | None:
        for prefix in kept:
            if longest - KEPT_SLACK <= prefix.length <= longest and prefix.key == reuse_key(
                    batch, batch.req_to_token[rows[i], : prefix.length]):
                return prefix.length
        return None

    out: list[SharedPrefix] = []
    for g in groups:
        length = kept_under(g.members[0], g.prefix_len) if g.prefix_len not in {p.length for p in kept} else None
        out.append(SharedPrefix(g.members, length) if length is not None else g)
    grouped = {i for g in groups for i in g.members}
    for i, (pre, ext) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
        if i not in grouped and ext >= 2:
            length = kept_under(i, pre)
            if length is not None:
                out.append(SharedPrefix((i,), length))
    return sorted(out, key=lambda g: g.members[0])


def reuse_key(batch: ForwardBatch, slots: torch.Tensor) -> tuple[int, bytes] | None:
    """The :attr:`SharedPart.reuse_key` of a prefix's ``slots`` in this batch's pool (None: nothing can be kept)."""
    if batch.kv_history is None or slots.device.type != "cpu":
        return None
    return batch.kv_history.times_freed(slots), slots.numpy().tobytes()


def _cascade_plan(batch: ForwardBatch, groups: list[SharedPrefix], starts: list[int], dtype: torch.dtype,
                  shared_before: list[SharedPart] | None = None) -> CascadePlan:
    """The groups' plan; ``shared_before``: their shared parts as planned for the batch before (see plan_batch)."""
    rows: list[int] = []
    spans: list[tuple[int, int]] = []  # each group's cascade rows
    prefills: list[PrefillChunk] = []
    single: list[int] = []
    single_skip: list[int] = []
    single_rows: list[int] = []
    owners: list[tuple[int, int]] = []  # (request, its group's P) of each member, in cascade row order
    for g in groups:
        first = len(rows)
        for i in g.members:
            pre, ext = batch.prefix_lens_cpu[i], batch.extend_lens_cpu[i]
            owners.append((i, g.prefix_len))
            if ext == 1:
                single.append(i)
                single_skip.append(g.prefix_len)
                single_rows.append(len(rows))
            elif ext > 1:
                prefills.append(_prefill_chunk(batch, i, len(rows), pre, ext, dtype, g.prefix_len))
            rows.extend(range(starts[i], starts[i] + ext))
        spans.append((first, len(rows)))
    shared = shared_before if shared_before is not None else [
        _shared_part(batch, g, start, end) for g, (start, end) in zip(groups, spans)]
    device = batch.seq_lens.device
    decode = None
    if single:
        decode = _decode_group(batch, single, single_skip, dtype, single_rows, len(rows))
    all_rows = len(rows) == batch.num_tokens and rows == list(range(len(rows)))
    row_index = None if all_rows else torch.tensor(rows, dtype=torch.int64, device=device)
    return CascadePlan(row_index, len(rows), shared, decode, prefills, _own_rows(batch, owners, prefills), groups)


def _own_rows(batch: ForwardBatch, owners: list[tuple[int, int]], prefills: list[PrefillChunk]) -> OwnRows | None:
    """Every cascade row's own part as one in-place call: where the plan has prefill chunks, all short, on the CPU.
    ``owners``: (request, P) of each group member in cascade row order."""
    if not prefills or batch.seq_lens.device.type != "cpu":
        return None
    if max(c.kv_index.numel() for c in prefills) > OWN_CHUNKS_MAX:
        return None
    seq, pre = batch.seq_lens_cpu, batch.prefix_lens_cpu
    own = [seq[i] - p for i, p in owners]  # a member's own positions after this step
    width = max(own)
    req_rows = batch.req_pool_indices[torch.tensor([i for i, _ in owners], dtype=torch.int64)]
    cols = torch.tensor([p for _, p in owners], dtype=torch.int64)[:, None] + torch.arange(width)
    cols.clamp_(max=batch.req_to_token.shape[1] - 1)  # past a member's own positions: stale, replaced below
    table = batch.req_to_token[req_rows[:, None], cols]
    table.masked_fill_(torch.arange(width)[None, :] >= torch.tensor(own)[:, None], 0)  # the reserved slot 0
    member: list[int] = []
    lengths: list[int] = []
    for m, ((i, p), n) in enumerate(zip(owners, own)):
        ext = batch.extend_lens_cpu[i]
        member.extend([m] * ext)
        lengths.extend(range(pre[i] - p + 1, n + 1))  # token j of the step sees its own positions up to itself
    return OwnRows(table, torch.tensor(member, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))


def _shared_part(batch: ForwardBatch, g: SharedPrefix, start: int, end: int) -> SharedPart:
    lead = int(batch.req_pool_indices[g.members[0]])
    index = batch.req_to_token[lead, : g.prefix_len]
    key = reuse_key(batch, index)
    # A prefix cached in one go often sits in consecutive slots: then it is read in place, no gather.
    first = int(index[0])
    if int(index[-1]) - first == g.prefix_len - 1 and bool((index[1:] - index[:-1] == 1).all()):
        return SharedPart(start, end, g.prefix_len, index, first, key)
    return SharedPart(start, end, g.prefix_len, index, None, key)

def _decode_group(batch: ForwardBatch, members: Sequence[int] | None, skip: Sequence[int] | None,
                  dtype: torch.dtype, token_rows: Sequence[int] | None = None,
                  num_rows: int = 0) -> DecodeGroup:
    """Padded slot matrix of the decode requests ``members`` (None = all, in order), from KV position
    ``skip[j]`` of member j on (None = from 0); ``token_rows`` are their rows among the ``num_rows``
    rows of the output (None = all of them, in order)."""
    device = batch.seq_lens.device
    if members is None:
        lens, req_rows, seq_lens = batch.seq_lens_cpu, batch.req_pool_indices, batch.seq_lens
    else:
        skips = skip or [0] * len(members)
        lens = [batch.seq_lens_cpu[i] - s for i, s in zip(members, skips)]
        req_rows = batch.req_pool_indices[torch.tensor(members, dtype=torch.int64, device=device)]
        seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    max_len = max(lens)
    if skip is None:
        index = batch.req_to_token[req_rows, :max_len]
    else:
        cols = torch.tensor(skip, dtype=torch.int64, device=device)[:, None] + torch.arange(max_len,
                                                                                           device=device)
        cols.clamp_(max=batch.req_to_token.shape[1] - 1)  # past a row's length: masked below
        index = batch.req_to_token[req_rows[:, None], cols]
    mask = None
    if min(lens) != max_len:
        pad = torch.arange(max_len, device=index.device)[None, :] >= seq_lens[:, None]
        # Table entries past a request's length are stale; point them at the reserved slot 0.
        index = index.masked_fill(pad, 0)
        mask = torch.zeros(pad.shape, dtype=dtype, device=index.device).masked_fill_(pad, float("-inf"))
        mask = mask[:, None, None, :]
    rows = None
    if token_rows is not None and list(token_rows) != list(range(num_rows)):
        rows = torch.tensor(token_rows, dtype=torch.int64, device=device)
    lengths = torch.tensor(lens, dtype=torch.int64) if device.type == "cpu" else None
    return DecodeGroup(index.reshape(-1), len(lens), max_len, mask, rows, lengths)

def _prefill_chunk(batch: ForwardBatch, i: int, start: int, prefix: int, ext: int,
                   dtype: torch.dtype, skip: int = 0) -> PrefillChunk:
    """KV positions ``skip .. prefix + ext - 1`` of request ``i`` (``skip`` = a cascade group's P)."""
    seq = prefix + ext
    index = batch.req_to_token[int(batch.req_pool_indices[i]), skip:seq]
    mask = None
    if prefix > skip:
        device = index.device
        # New token j (position prefix + j) may see key positions skip .. prefix + j.
        hidden = (torch.arange(skip, seq, device=device)[None, :]
                  > torch.arange(prefix, seq, device=device)[:, None])
        if hidden.numel() > _FLOAT_MASK_LIMIT:
            mask = ~hidden  # bool (True = attend): 4x smaller than additive fp32, slightly slower
        else:
            mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
            mask.masked_fill_(hidden, float("-inf"))
    return PrefillChunk(start, start + ext, index, mask)
