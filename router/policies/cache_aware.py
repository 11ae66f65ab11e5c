"""cache_aware: route a request where its prefix was sent before, unless that would unbalance the load.

``AffinityPolicy`` holds the decision rule shared with exact mode; only where the match lengths come from
differs (a guess here, the workers' real caches there):

1. The best worker is the one with the longest match (ties: least loaded). It gets the request when the
   match is at least ``cache_threshold`` of the prompt: a short common prefix (a shared system prompt that
   every worker holds anyway) is not worth piling load on one worker.
2. The load-imbalance guard: if sending it there would leave the in-flight counts spread by more than
   ``balance_abs_threshold`` *and* the busiest above ``balance_rel_threshold`` times the least busy, the
   request goes to the least loaded worker instead (reason "balance"). The test is on the loads *after*
   placing the request, so routing for the cache never itself pushes the spread over the guard.
3. Otherwise (no worthwhile match) the least loaded worker gets it; ties go to the worker whose cache
   holds least (the most room), then to the least recently chosen.

``CacheAware`` keeps, per worker, a ``PrefixTree`` of the prompts routed there (and of prompt + answer once
the answer is known, since the worker caches the answer too). Text trees (the default) key on the prompt
text or serialised chat messages: no tokenizer, cheap, fine for remote workers; they measure in bytes.
Token trees key on token ids and need the tokenizer; their units are the worker's.
"""

from __future__ import annotations

from abc import abstractmethod
from array import array
from typing import Any

from router.policies.base import Choice, Policy, imbalanced
from router.prefix_tree import PrefixTree
from router.request_view import TAG_BYTES, RequestView, namespace_tag
from router.workers import Worker


class AffinityPolicy(Policy):
    def __init__(self, cache_threshold: float, balance_abs_threshold: int, balance_rel_threshold: float):
        super().__init__()
        self.threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.guard_overrides = 0

    @abstractmethod
    def matches(self, view: RequestView, candidates: list[Worker]) -> tuple[dict[str, int], int] | None:
        """(predicted match per worker URL, prompt length), or None when the request has no usable key."""

    @abstractmethod
    def held(self, worker: Worker) -> int:
        """How much the policy believes the worker's cache holds (tie-break: emptier first)."""

    def _best_by_load(self, workers: list[Worker], m: dict[str, int]) -> list[Worker]:
        """Fewest in flight first; then the longest match in ``m``, the emptiest cache, the least recent."""
        return sorted(workers, key=lambda w: (w.load, -m.get(w.url, 0), self.held(w),
                                              self._last_pick.get(w.url, 0)))

    def select(self, view: RequestView, candidates: list[Worker]) -> Choice:
        found = self.matches(view, candidates)
        if found is None:
            return self.pick(self._best_by_load(candidates, {}), "load")
        m, total = found
        best = max((m.get(w.url, 0) for w in candidates), default=0)
        if best > 0 and total > 0 and best >= self.threshold * total:
            target = self._best_by_load([w for w in candidates if m.get(w.url, 0) == best], m)[0]
            loads = [w.load + (w is target) for w in candidates]
            if not imbalanced(loads, self.abs_threshold, self.rel_threshold):
                return self.pick([target], "cache", match=best, prompt_units=total)
            self.guard_overrides += 1
            chosen = self._best_by_load(candidates, m)
            return self.pick(chosen, "balance", match=m.get(chosen[0].url, 0), prompt_units=total)
        # Not worth following: partial matches do not break ties here either, or every new conversation
        # would pile onto the worker holding the most common system prompt whenever loads are equal.
        chosen = self._best_by_load(candidates, {})
        return self.pick(chosen, "load", match=m.get(chosen[0].url, 0), prompt_units=total)


class CacheAware(AffinityPolicy):
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 8,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 22, tree_mode: str = "text"):
        super().__init__(cache_threshold, balance_abs_threshold, balance_rel_threshold)
        if tree_mode not in ("text", "tokens"):
            raise ValueError(f"tree_mode: must be text or tokens, not {tree_mode!r}")
        self.tree_mode = tree_mode
        self.needs_tokenizer = tree_mode == "tokens"
        self.unit_bytes = 4 if tree_mode == "tokens" else 1
        self.max_tree_size = max_tree_size
        self.unit = "tokens" if tree_mode == "tokens" else "bytes"
        self.trees: dict[str, PrefixTree] = {}

    # ------------------------------------------------------------------ keys
    def _key(self, view: RequestView) -> bytes | None:
        if self.tree_mode == "text":
            return view.text_key()[0] if view.routable else None
        if self.tokenizer is None:
            return None
        ids = self.tokenizer.prompt_ids(view)
        return None if not ids else namespace_tag(b"K", view.namespace) + array("i", ids).tobytes()

    def _completion_key(self, view: RequestView, completion: str) -> bytes | None:
        if self.tree_mode == "text":
            return view.text_key_with_completion(completion) if view.input_ids is None else None
        if self.tokenizer is None:
            return None
        ids = self.tokenizer.ids_with_completion(view, completion)
        return None if not ids else namespace_tag(b"K", view.namespace) + array("i", ids).tobytes()

    def prepare(self, view: RequestView) -> None:
        view.key = self._key(view)

    # ------------------------------------------------------------------ policy
    def matches(self, view: RequestView, candidates: list[Worker]) -> tuple[dict[str, int], int] | None:
        key = view.key
        if key is None:
            return None
        ub, tag = self.unit_bytes, TAG_BYTES // self.unit_bytes
        m = {}
        for w in candidates:
            tree = self.trees.get(w.url)
            m[w.url] = max(0, tree.match(key) - tag) if tree is not None else 0
        return m, len(key) // ub - tag

    def held(self, worker: Worker) -> int:
        tree = self.trees.get(worker.url)
        return tree.size if tree is not None else 0

    def select(self, view: RequestView, candidates: list[Worker]) -> Choice:
        choice = super().select(view, candidates)
        key = view.key
        tree = self.trees.get(choice.worker.url)
        if key is not None and tree is not None:
            # Recorded now, not when the answer comes: the next requests of the same group, sent while
            # this one runs, should follow it to the worker that is computing the prefix.
            tree.insert(key)
        return choice

    def on_finished(self, view: RequestView, choice: Choice, ok: bool, completion: str | None) -> None:
        tree = self.trees.get(choice.worker.url)
        if ok and completion and tree is not None:
            key = self._completion_key(view, completion)
            if key is not None:
                tree.insert(key)

    def add_worker(self, worker: Worker) -> None:
        self.trees.setdefault(worker.url, PrefixTree(self.max_tree_size, self.unit_bytes))

    def remove_worker(self, worker: Worker) -> None:
        super().remove_worker(worker)
        self.trees.pop(worker.url, None)

    def reset(self) -> None:
        for tree in self.trees.values():
            tree.clear()

    def describe(self, worker: Worker) -> dict[str, Any]:
        tree = self.trees.get(worker.url)
        if tree is None:
            return {}
        return {"tree_size": tree.size, "tree_pruned": tree.pruned, "tree_unit": self.unit}
