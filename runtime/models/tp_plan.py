"""Which slice of the model each tensor-parallel rank holds (Megatron-style), decided once from the shapes.

Attention is split by query heads, and every rank holds the KV heads its query heads read, so a rank's
attention is ordinary grouped-query attention over its own KV pool shard and needs no communication:

* ``tp <= num_kv_heads``: whole GQA groups (one KV head and the query heads that read it) per rank, as even
  as possible; SmolLM2 (9 query / 3 KV heads) at tp 2 gives ranks 6+2 and 3+1 heads (query+KV): nothing
  is replicated, the ranks' attention work is uneven (2:1) while the MLP and vocabulary halves are even.
* ``tp > num_kv_heads``: each group is shared by several ranks, each taking a contiguous slice of the
  group's query heads and a replica of its KV head (the usual KV-head replication). Needs ``tp <=
  num_heads``: a rank with no query head would hold nothing to attend with.

The MLP's intermediate dimension and the vocabulary are split in contiguous, balanced ranges. A split
that is not even is correct (every rank runs its own shapes); it only costs balance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.distributed.comm import TPComm


class TPConfigError(ValueError):
    """A ``--tp-size`` this model's shape cannot be split into."""


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``: global ``[start, end)`` ranges of what it holds."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def inter_size(self) -> int:
        return self.inter[1] - self.inter[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


def balanced(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, end)`` ranges covering ``0..total``, sizes differing by at most one."""
    out, start = [], 0
    for i in range(parts):
        n = total // parts + (1 if i < total % parts else 0)
        out.append((start, start + n))
        start += n
    return out


def _head_ranges(num_heads: int, num_kv_heads: int, tp: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per rank: (query-head range, KV-head range)."""
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        return [((g0 * group, g1 * group), (g0, g1)) for g0, g1 in balanced(num_kv_heads, tp)]
    out = []
    for g, (r0, r1) in enumerate(balanced(tp, num_kv_heads)):  # the ranks sharing group g
        for q0, q1 in balanced(group, r1 - r0):
            out.append(((g * group + q0, g * group + q1), (g, g + 1)))
    return out


def plan_shards(num_heads: int, num_kv_heads: int, intermediate: int, vocab: int, tp: int) -> list[Shard]:
    """Every rank's shard; :class:`TPConfigError` (naming the constraint) for a size that cannot work."""
    if tp < 1:
        raise TPConfigError(f"--tp-size must be >= 1, got {tp}")
    if tp > num_heads:
        raise TPConfigError(
            f"--tp-size {tp} is larger than the model's {num_heads} attention heads: tensor parallelism splits "
            f"attention by query heads (each rank needs at least one); use --tp-size <= {num_heads}")
    if intermediate < tp or vocab < tp:
        raise TPConfigError(f"--tp-size {tp} exceeds the MLP width {intermediate} or the vocabulary {vocab}")
    heads = _head_ranges(num_heads, num_kv_heads, tp)
    inter, voc = balanced(intermediate, tp), balanced(vocab, tp)
    return [Shard(r, tp, heads[r][0], heads[r][1], inter[r], voc[r]) for r in range(tp)]


@dataclass
class TPContext:
    """What a sharded model needs at run time: its shard, the collectives, and every rank's shard (the
    logits gather pads to the widest vocabulary slice)."""

    shard: Shard
    comm: TPComm
    shards: list[Shard]

    @classmethod
    def for_rank(cls, shards: list[Shard], comm: TPComm) -> TPContext:
        return cls(shards[comm.rank], comm, shards)

    @property
    def vocab_widths(self) -> list[int]:
        return [s.vocab_size for s in self.shards]


# Where each weight's rank-local rows/columns come from. Keys are name suffixes; a value is (dim, pieces),
# each piece a global (start, length) along dim, the pieces concatenated in order.
Pieces = tuple[int, list[tuple[int, int]]]


def hf_pieces(name: str, shard: Shard, num_heads: int, num_kv_heads: int, head_dim: int) -> Pieces | None:
    """The slice of HF checkpoint tensor ``name`` that ``shard`` holds (None: the whole tensor, replicated)."""
    d = head_dim
    q = (shard.q_heads[0] * d, shard.num_heads * d)
    kv = (shard.kv_heads[0] * d, shard.num_kv_heads * d)
    inter = (shard.inter[0], shard.inter_size)
    table: dict[str, Pieces] = {
        "q_proj.weight": (0, [q]), "q_proj.bias": (0, [q]),
        "k_proj.weight": (0, [kv]), "k_proj.bias": (0, [kv]),
        "v_proj.weight": (0, [kv]), "v_proj.bias": (0, [kv]),
        "o_proj.weight": (1, [q]),
        "gate_proj.weight": (0, [inter]), "gate_proj.bias": (0, [inter]),
        "up_proj.weight": (0, [inter]), "up_proj.bias": (0, [inter]),
        "down_proj.weight": (1, [inter]),
        "embed_tokens.weight": (0, [(shard.vocab[0], shard.vocab_size)]),
        "lm_head.weight": (0, [(shard.vocab[0], shard.vocab_size)]),
    }
    return next((v for k, v in table.items() if name.endswith(k)), None)


def fused_pieces(name: str, shard: Shard, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate: int) -> Pieces | None:
    """The same for our own (fused) parameter names: ``qkv_weight`` is ``[q | k | v]`` rows, ``gate_up_weight``
    ``[gate | up]`` rows (used to shard a full-size tensor drawn for a random-weight model)."""
    d = head_dim
    q_full, kv_full = num_heads * d, num_kv_heads * d
    q = (shard.q_heads[0] * d, shard.num_heads * d)
    k = (q_full + shard.kv_heads[0] * d, shard.num_kv_heads * d)
    v = (k[0] + kv_full, k[1])
    g = (shard.inter[0], shard.inter_size)
    u = (intermediate + g[0], g[1])
    table: dict[str, Pieces] = {
        "qkv_weight": (0, [q, k, v]), "qkv_bias": (0, [q, k, v]),
        "o_weight": (1, [q]),
        "gate_up_weight": (0, [g, u]), "gate_up_bias": (0, [g, u]),
        "down_weight": (1, [g]),
        "embed_tokens": (0, [(shard.vocab[0], shard.vocab_size)]),
        "lm_head": (0, [(shard.vocab[0], shard.vocab_size)]),
    }
    return next((v for k_, v in table.items() if name.endswith(k_)), None)


def take(tensor: torch.Tensor, pieces: Pieces | None) -> torch.Tensor:
    """``tensor``'s shard described by ``pieces`` (the tensor itself for None)."""
    if pieces is None:
        return tensor
    dim, parts = pieces
    views = [tensor.narrow(dim, start, length) for start, length in parts]
    return views[0] if len(views) == 1 else torch.cat(views, dim)
