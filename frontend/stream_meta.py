"""The ``meta_info`` of a streamed generation, frame by frame, in SGLang's incremental form.

SGLang's ``text_async_iter(var, return_meta_data=True)`` yields ``(new text, meta_info)`` where the output
logprob lists hold only the tokens of that chunk and ``output_token_logprobs_length`` counts all of them so
far. Servers differ in what a stream frame carries: SGLang sends incremental lists when its
``incremental_streaming_output`` is on and cumulative ones otherwise (as radixserve does). ``StreamMeta``
accepts either and gives both views: the chunk's increment for the iterator, and the cumulative meta_info
that ``get_meta_info`` returns once the generation is done (the same as a non-streamed call's).
"""

from __future__ import annotations

from typing import Any

INCREMENTAL_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class StreamMeta:
    def __init__(self) -> None:
        self.seen: dict[str, list[Any]] = {}

    def feed(self, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(this frame's increment, everything so far) for one frame's meta_info."""
        delta, full = dict(meta), dict(meta)
        for key in INCREMENTAL_KEYS:
            if key not in meta or meta[key] is None:
                continue
            values, seen = list(meta[key]), self.seen.setdefault(key, [])
            new = values[len(seen):] if self._is_cumulative(meta, values, seen) else values
            seen.extend(new)
            delta[key], full[key] = new, list(seen)
        if "output_token_logprobs" in self.seen:
            delta["output_token_logprobs_length"] = full["output_token_logprobs_length"] = \
                len(self.seen["output_token_logprobs"])
        return delta, full

    @staticmethod
    def _is_cumulative(meta: dict[str, Any], values: list[Any], seen: list[Any]) -> bool:
        if not seen:
            return False  # the first frame reads the same either way
        total = meta.get("output_token_logprobs_length", meta.get("completion_tokens"))
        if isinstance(total, int):
            if len(values) == total and len(values) >= len(seen):
                return True
            if len(values) == total - len(seen):
                return False
        # A server that counts differently: a cumulative list starts with what was already seen.
        return len(values) >= len(seen) and values[:len(seen)] == seen


def merge_increments(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Several frames' increments as one chunk's: the lists concatenated, other fields from the last frame."""
    merged = dict(metas[-1])
    for key in INCREMENTAL_KEYS:
        if any(key in m for m in metas):
            merged[key] = [item for m in metas for item in (m.get(key) or [])]
    return merged
