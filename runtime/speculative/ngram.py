"""N-gram drafting: propose the next tokens of a request by finding its recent suffix elsewhere and copying
what followed it there.

Two sources are searched for the request's last ``min_match`` tokens:

* the request's own prompt and output (prompt lookup: agents copy file text and tool arguments from their
  context, answers repeat the examples' shape). A scan of its int32 bytes (``bytes.rfind``, memchr speed)
  from the end finds the most recent occurrences first;
* :class:`SequenceStore`, the prompts and outputs of finished requests (the sequences the scheduler just
  handed to the radix cache), per cache namespace, indexed by their ``min_match``-grams. The radix tree is
  keyed by prefixes from its roots, so finding a suffix in the middle of a cached sequence would need a scan
  of the tree; the store is that suffix index, bounded by its own token capacity (oldest sequences leave
  first) and cleared with the cache.

Every occurrence is extended backwards to its full match length (at most ``max_match``). The draft follows
the occurrences with the longest match; where they disagree on a next token, the token most of them continue
with wins (ties: the most recent occurrence, own sequence first), and only the agreeing ones go on.
Drafts are only proposals: verification by the model decides what is emitted, so a bad draft costs time,
never correctness.
"""

from __future__ import annotations

import itertools
from array import array
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from runtime.speculative.drafter import Drafter, DraftJob, DraftSlots

WORD = 4  # bytes per token id in an int32 array


@dataclass(frozen=True)
class NgramConfig:
    num_draft_tokens: int = 4  # K: most tokens proposed per request per step
    min_match: int = 2  # shortest suffix worth copying from
    max_match: int = 8  # longest suffix compared (longer matches rank equal)
    capacity: int = 1 << 18  # tokens of finished sequences kept for drafting
    max_candidates: int = 32  # occurrences of the suffix examined per source (the most recent ones)


@dataclass
class Occurrence:
    match: int  # tokens of the request's suffix that precede this continuation
    seq: Sequence[int]
    start: int  # position in ``seq`` of the first continuation token


def own_occurrences(tokens: array, cfg: NgramConfig) -> list[Occurrence]:
    """Earlier occurrences of the last ``min_match`` tokens of ``tokens`` in ``tokens``, most recent first."""
    n, length = cfg.min_match, len(tokens)
    if length <= n:
        return []
    hay = tokens.tobytes()
    pat = hay[-WORD * n :]
    hi = WORD * (length - 1)  # an occurrence must end before the last token: something follows it
    suffix_at = length - n
    out: list[Occurrence] = []
    while len(out) < cfg.max_candidates:
        b = hay.rfind(pat, 0, hi)
        if b < 0:
            break
        hi = b + len(pat) - 1  # the next search finds occurrences starting left of this one
        if b % WORD:
            continue  # a match across token boundaries
        p = b // WORD
        out.append(Occurrence(n + _extend_back(tokens, p, tokens, suffix_at, cfg.max_match - n), tokens, p + n))
    return out


def _extend_back(seq: Sequence[int], p: int, tokens: Sequence[int], q: int, most: int) -> int:
    """How many tokens before ``seq[p]`` equal those before ``tokens[q]`` (at most ``most``)."""
    m = 0
    while m < most and p - m - 1 >= 0 and seq[p - m - 1] == tokens[q - m - 1]:
        m += 1
    return m


def choose_draft(occurrences: list[Occurrence], k: int) -> list[int]:
    """Up to ``k`` tokens following the best-evidenced occurrences (see the module docstring)."""
    if not occurrences or k <= 0:
        return []
    best = max(o.match for o in occurrences)
    pool = [o for o in occurrences if o.match == best]
    draft: list[int] = []
    for j in range(k):
        nxt = [(o, o.seq[o.start + j]) for o in pool if o.start + j < len(o.seq)]
        if not nxt:
            break
        token = Counter(t for _, t in nxt).most_common(1)[0][0]  # stable: ties keep the first seen
        draft.append(token)
        pool = [o for o, t in nxt if t == token]
    return draft


class SequenceStore:
    """Finished requests' token sequences, indexed by their ``n``-grams, per namespace (see the docstring).

    Each position after an ``n``-gram is one index entry (``sequence id << 32 | position``), appended in
    arrival order, so the oldest sequence's entries lead every list they are in: dropping it (capacity) cuts
    list heads. Indexing costs one dict operation per token when a request finishes."""

    def __init__(self, n: int, capacity: int, per_key: int):
        self.n = n
        self.capacity = capacity
        self.per_key = per_key  # most entries of one n-gram examined per lookup (the most recent)
        self._seqs: OrderedDict[int, tuple[Hashable | None, array]] = OrderedDict()
        self._index: dict[Hashable | None, dict[bytes, list[int]]] = {}
        self._ids = itertools.count()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def _keys(self, seq: array) -> list[bytes]:
        raw, step = seq.tobytes(), WORD * self.n
        return [raw[i : i + step] for i in range(0, len(raw) - step, WORD)]  # the n-grams followed by a token

    def add(self, tokens: array, namespace: Hashable | None) -> None:
        if self.capacity <= 0 or len(tokens) <= self.n:
            return
        seq = array("i", tokens[-self.capacity :])
        sid = next(self._ids)
        self._seqs[sid] = (namespace, seq)
        self.tokens += len(seq)
        put = self._index.setdefault(namespace, {}).setdefault
        base = (sid << 32) + self.n
        for p, key in enumerate(self._keys(seq), base):
            put(key, []).append(p)
        while self.tokens > self.capacity:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        sid, (namespace, seq) = self._seqs.popitem(last=False)
        self.tokens -= len(seq)
        index = self._index[namespace]
        for key in self._keys(seq):
            entries = index.get(key)
            if entries is None:
                continue  # this n-gram's entries of the sequence went with an earlier key (a repeat)
            cut = 0
            while cut < len(entries) and entries[cut] >> 32 == sid:
                cut += 1
            if cut == len(entries):
                del index[key]
            elif cut:
                del entries[:cut]

    def occurrences(self, tokens: array, namespace: Hashable | None, max_match: int) -> list[Occurrence]:
        """Occurrences of the last ``n`` tokens of ``tokens`` in stored sequences of ``namespace``, most recent
        first."""
        n, length = self.n, len(tokens)
        index = self._index.get(namespace)
        if length < n or not index:
            return []
        entries = index.get(tokens[length - n :].tobytes())
        if not entries:
            return []
        out: list[Occurrence] = []
        for e in entries[: -self.per_key - 1 : -1]:
            seq, p = self._seqs[e >> 32][1], e & 0xFFFFFFFF
            out.append(Occurrence(n + _extend_back(seq, p - n, tokens, length - n, max_match - n), seq, p))
        return out

    def clear(self) -> None:
        self._seqs.clear()
        self._index.clear()
        self.tokens = 0


class NgramDrafter(Drafter):
    """Drafts for running requests from their own tokens and the finished ones' (see the module docstring)."""

    def __init__(self, cfg: NgramConfig):
        self.cfg = cfg
        self.store = SequenceStore(cfg.min_match, cfg.capacity, cfg.max_candidates)

    def draft(self, jobs: Sequence[DraftJob], slots: DraftSlots) -> list[list[int]]:
        """The draft comes first and its slots after: a step where nothing matches allocates nothing."""
        out: list[list[int]] = []
        for i, job in enumerate(jobs):
            draft = self.propose(job.tokens, job.namespace, min(job.k, slots.budget))
            out.append(draft if draft and slots.reserve(i, len(draft)) else [])
        return out

    def propose(self, tokens: array, namespace: Hashable | None, k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``tokens`` (empty: no evidence)."""
        if k <= 0 or len(tokens) < self.cfg.min_match:
            return []
        found = own_occurrences(tokens, self.cfg) + self.store.occurrences(tokens, namespace, self.cfg.max_match)
        return choose_draft(found, k)

    def remember(self, tokens: array, namespace: Hashable | None) -> None:
        """A finished request's prompt and output become draft material for later requests."""
        self.store.add(tokens, namespace)

    def finished(self, tokens: array, cached_tokens: int, namespace: Hashable | None) -> None:
        """Its cached prefix came from earlier requests, already remembered (multi-turn chats and agent loops
        resend their transcript), so only the tokens from shortly before it are indexed again."""
        self.remember(tokens[max(0, cached_tokens - self.cfg.max_match) :], namespace)

    def clear(self) -> None:
        self.store.clear()
