"""Shared-prefix ("cascade") attention: the planning rule and the two-part math, device-agnostic.

Requests under one cached prefix (few-shot block, system prompt, n parallel samples) hold the *same* KV
slots for it: the radix cache hands every request the same pages. Attending each request over its whole
KV re-gathers that prefix once per request per layer, which makes a CPU decode step memory-bound on
copies. Softmax attention splits exactly over a partition of the keys, so for a group of requests that
share slots ``0 .. P-1`` every query row of the group is computed as

1. the shared part: all of the group's query rows against ``K[0:P]`` / ``V[0:P]``, gathered once per layer,
   in one call with no mask (every new token sees the whole shared prefix);
2. its own part: KV positions ``P .. seq_len - 1`` with the usual causal rule for the new tokens;
3. a merge by log-sum-exp: with ``lse = log sum exp(scores) = m + log s`` of each part (row max m, sum
   s of e^(score - m)), ``out = o1 * w + o2 * (1 - w)`` where ``w = s1 e^m1 / (s1 e^m1 + s2 e^m2)
   = sigmoid(lse1 - lse2)``, in fp32 whatever the pool dtype.

This module holds the pieces that do not depend on a backend's batching: :func:`find_shared_prefixes`
(which requests to group, and how long a prefix; :class:`SharedPrefixFinder` keeps a decode wave's answer from one
step to the next), :func:`attention_with_lse` and :func:`merge_attention_`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# The CPU flash-attention kernel behind ``F.scaled_dot_product_attention`` also returns the log-sum-exp
# we need for the merge, without materialising the score matrix. Other devices use the explicit math.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class CascadePolicy:
    """When a shared prefix is worth the split.

    Cascade adds fixed per-layer work (one more attention call per group, a merge over the group's rows,
    ~40 µs per layer on the 2-core development machine, ~100 µs when the group is only part of a decode
    batch) and saves gathering ``(members - 1) * P`` KV rows per layer (~0.1 µs each at SmolLM2's 3 KV heads
    x 64 dims, K and V). Measured break-even (one layer, SmolLM2 shape): 500-700 saved rows, whatever the
    mix of group size and P; below P = 32 the shared call is too small to pay for itself.
    """

    min_prefix: int = 32  # shortest shared prefix P worth a group
    min_saved_tokens: int = 768  # (members - 1) * P: KV rows per layer gathered once instead of per member

    def __post_init__(self) -> None:
        if self.min_prefix < 1:
            raise ValueError(f"min_prefix must be >= 1, got {self.min_prefix}")


@dataclass(frozen=True)
class SharedPrefix:
    """Requests (indices into the batch, ascending) whose KV slots ``0 .. prefix_len - 1`` are identical."""

    members: tuple[int, ...]
    prefix_len: int


def find_shared_prefixes(req_to_token: torch.Tensor, req_rows: Sequence[int], prefix_lens: Sequence[int],
                         policy: CascadePolicy) -> list[SharedPrefix]:
    """Group the batch's requests by shared leading KV slots (once per batch, in ``plan``).

    Only KV already in the pool before this step may be shared (``P <= prefix_len`` of every member), so
    the slots the step writes, and the causal rule among new tokens, stay in each request's own part.

    Candidates are bucketed by the slot of position 0, then each bucket is walked like the radix tree it
    came from (:meth:`_Walk.best_groups`): at each branch point P, members either share P as one group or go
    down into a branch that saves more on its own. A request is in at most one group, so nested sharing
    (n samples under a few-shot block) becomes one group per level only where that saves more gathers.
    """
    cand = [i for i, p in enumerate(prefix_lens) if p >= policy.min_prefix]
    if len(cand) < 2:
        return []
    rows = torch.tensor([req_rows[i] for i in cand], dtype=torch.int64, device=req_to_token.device)
    buckets: dict[int, list[int]] = {}
    for i, slot in zip(cand, req_to_token[rows, 0].tolist()):
        buckets.setdefault(slot, []).append(i)
    walk = _Walk(req_to_token, req_rows, prefix_lens, policy)
    groups = [g for members in buckets.values() if len(members) >= 2 for g in walk.best_groups(members, 1)[1]]
    return sorted(groups, key=lambda g: g.members[0])


class SharedPrefixFinder:
    """:func:`find_shared_prefixes` for one backend's batches, in order: a decode batch of the same requests as the
    decode batch before it, each one token further, gets that batch's groups back instead of a new walk.

    Why it is the same answer: between two such batches every request added one KV slot of its own (a decoded
    token's slot is never shared), and a running request's slots below its cached length do not change. So each
    branch point of the walk, and which members share it, stay as they were, as long as no request crossed
    ``min_prefix`` (the candidates) between them. The walk cost ~0.3 ms of a ~15 ms batch-8 decode step on the
    2-core CPU host, every step, for the same answer while a few-shot wave decodes.

    What the reuse checks besides the request rows and lengths: each group's members still hold their leader's
    slot at position ``P - 1``. A table row handed to another request in between (one request finished, another
    took its row) then either shares the whole prefix too (a slot reached through the radix tree is reached by one
    path only) or makes this batch walk again.
    """

    def __init__(self, policy: CascadePolicy):
        self.policy = policy
        # the last decode batch: its request rows, their cached lengths, its groups (None after any other batch)
        self._last: tuple[tuple[int, ...], tuple[int, ...], list[SharedPrefix]] | None = None
        # whether the last find carried the decode batch before it over (its batch is that one moved one token on,
        # with the same groups): what was planned for that batch's groups may be planned again as it was
        self.carried = False

    def find(self, req_to_token: torch.Tensor, req_rows: Sequence[int], prefix_lens: Sequence[int],
             decode: bool) -> list[SharedPrefix]:
        """The groups of a batch (``decode``: every request adds one token), as ``find_shared_prefixes``."""
        rows, lens = tuple(req_rows), tuple(prefix_lens)
        kept = self._kept_groups(req_to_token, rows, lens) if decode else None
        self.carried = kept is not None
        groups = kept if kept is not None else find_shared_prefixes(req_to_token, rows, lens, self.policy)
        self._last = (rows, lens, groups) if decode else None
        return list(groups)

    def _kept_groups(self, req_to_token: torch.Tensor, rows: tuple[int, ...],
                     lens: tuple[int, ...]) -> list[SharedPrefix] | None:
        """The last decode batch's groups where this batch is that one moved one token on, else None."""
        if self._last is None:
            return None
        last_rows, last_lens, groups = self._last
        low = self.policy.min_prefix
        if rows != last_rows or any(n != m + 1 or (n >= low) != (m >= low) for n, m in zip(lens, last_lens)):
            return None
        if not groups:
            return groups
        # one gather: each member's slot at its group's P - 1 (row 0) and its leader's (row 1)
        pairs = [(rows[i], rows[g.members[0]], g.prefix_len - 1) for g in groups for i in g.members]
        index = torch.tensor(pairs, dtype=torch.int64, device=req_to_token.device)
        slots = req_to_token[index[:, :2].T, index[:, 2]]
        return groups if bool((slots[0] == slots[1]).all()) else None


class _Walk:
    """The recursive grouping of one batch; ``budget`` caps the branch points visited (worst case O(n^2)
    table comparisons for a comb-shaped tree; real prefix trees branch a few times)."""

    def __init__(self, req_to_token: torch.Tensor, req_rows: Sequence[int], prefix_lens: Sequence[int],
                 policy: CascadePolicy, budget: int = 64):
        self.table, self.req_rows, self.caps, self.policy = req_to_token, req_rows, prefix_lens, policy
        self.budget = budget

    def _pays(self, members: int, p: int) -> int:
        saved = (members - 1) * p
        return saved if members >= 2 and p >= self.policy.min_prefix and saved >= self.policy.min_saved_tokens else 0

    def best_groups(self, members: list[int], depth: int) -> tuple[int, list[SharedPrefix]]:
        """(saved gathers, groups) for ``members``, which share their first ``depth`` slots."""
        self.budget -= 1
        caps = self.caps
        lead = max(members, key=lambda i: caps[i])  # its row covers every other member's prefix
        limit = max(caps[i] for i in members if i != lead)
        rows = torch.tensor([self.req_rows[i] for i in members], dtype=torch.int64, device=self.table.device)
        seg = self.table[rows, depth:limit]
        same = seg == seg[members.index(lead)]
        run = (same.to(torch.int32).cumprod(1).sum(1) + depth).tolist()  # slots shared with the leader
        p = min(min(r, caps[i]) for r, i in zip(run, members))  # first branch point (or a prefix's end)
        nxt = self.table[rows, min(p, self.table.shape[1] - 1)].tolist()
        branches: dict[int, list[int]] = {}
        stay = []  # members that join a group at p: those whose cached prefix ends there, and below
        for i, slot in zip(members, nxt):
            if caps[i] > p:
                branches.setdefault(slot, []).append(i)
            else:
                stay.append(i)
        # A branch goes down on its own if that saves more than its members add to a group at p.
        deep_saved, deep = 0, []
        all_deep_saved, all_deep = 0, []
        for branch in branches.values():
            saved, groups = self.best_groups(branch, p + 1) if len(branch) >= 2 and self.budget > 0 else (0, [])
            all_deep_saved += saved
            all_deep += groups
            if saved > len(branch) * p:
                deep_saved += saved
                deep += groups
            else:
                stay += branch
        here = self._pays(len(stay), p)
        if here and deep_saved + here >= all_deep_saved:
            return deep_saved + here, [*deep, SharedPrefix(tuple(sorted(stay)), p)]
        return all_deep_saved, all_deep


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``[..., M, D]`` and its log-sum-exp ``[..., M]`` (fp32) over 4-D q/k/v.

    ``mask`` is additive (``q.dtype``) or bool (True = attend), broadcastable to ``[..., M, N]``;
    ``is_causal`` is the top-left-aligned causal rule (used only with ``M == N``).
    """
    if mask is not None and mask.dtype == torch.bool:
        # The fused kernel takes additive masks only (SDPA converts bool ones the same way).
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    if _CPU_FLASH is not None and q.device.type == "cpu":
        out, lse = _CPU_FLASH(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        return out, lse
    # Explicit math in fp32 (any device): scores, log-sum-exp, normalised probabilities times V.
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if is_causal:
        m, n = scores.shape[-2:]
        future = torch.ones(m, n, dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(future, float("-inf"))
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(probs, v.float()).to(q.dtype), lse


def merge_attention_(out: torch.Tensor, lse: torch.Tensor, o_other: torch.Tensor,
                     lse_other: torch.Tensor) -> None:
    """Turn ``out`` (attention over one key set, log-sum-exp ``lse``) into attention over the union with a
    disjoint key set whose attention is ``o_other`` / ``lse_other``; in place, any matching layouts.

    ``out``/``o_other``: ``[..., D]``, ``lse``/``lse_other``: ``[...]`` fp32. The weight of the other part
    is ``e^lse_other / (e^lse + e^lse_other) = sigmoid(lse_other - lse)``: no overflow whatever the
    magnitudes, no separate max/sum bookkeeping. Computed in fp32 whatever ``out``'s dtype; ``lse`` is
    not updated (a row is merged once).
    """
    w = torch.sigmoid(lse_other - lse).unsqueeze(-1)
    if out.dtype == torch.float32:
        out.lerp_(o_other, w)  # out + w * (o_other - out)
    else:
        out.copy_(out.float().lerp_(o_other.float(), w))
