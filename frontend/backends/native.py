"""NativeBackend: everything a backend that speaks SGLang's native ``/generate`` protocol shares.

RuntimeEndpoint (HTTP) and EngineBackend (in-process) differ only in how a request dict reaches the
runtime (``_call`` / ``_call_stream``); the requests themselves, and so the results, are identical.

``select`` scoring, step by step (the same requests and prefix handling as SGLang's frontend):

1. The prompt ``P`` is sent as a prefill-only request (``max_new_tokens: 0``). It caches ``P`` and
   tells how many tokens ``P`` has (``prompt_tokens`` = n).
2. ``P + choice`` for every choice goes in one batched prefill-only request with ``return_logprob`` and
   ``logprob_start_len = max(n - 2, 0)``. Starting two tokens before the boundary matters because a
   tokenizer may merge the end of ``P`` with the start of a choice ("A: " + "Paris" -> ``" Paris"``), so
   the tokens of the boundary region differ between choices and must be scored too.
3. If ``P`` ends with the text of the first returned token, that token belongs to the unchanged prefix,
   so it is dropped (no merge happened there); the rest are the scored entries of that choice.
4. The entries' mean logprob is the choice's length-normalised score; the choice method decides
   (``choices.py``). ``unconditional_likelihood_normalized`` also scores the same token ids alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from frontend.backends.base import BaseBackend, FeatureNotSupported, GenResult
from frontend.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from frontend.ir import GenParams

if TYPE_CHECKING:
    from frontend.interpreter import StreamExecutor

GREEDY_EPS = 1e-5


class NativeBackend(BaseBackend):
    # ------------------------------------------------------------------ transport (subclasses)
    def _call(self, payload: dict[str, Any]) -> Any:
        """One non-streaming ``/generate`` request: a dict, or a list for a batch."""
        raise NotImplementedError

    def _call_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """One streaming ``/generate`` request: frames whose ``text`` is cumulative."""
        raise NotImplementedError

    # ------------------------------------------------------------------ BaseBackend
    def cache_prefix(self, prefix_str: str) -> dict[str, Any] | None:
        if not prefix_str:
            return None
        out = self._call({"text": prefix_str, "sampling_params": {"max_new_tokens": 0}})
        return dict(out["meta_info"])

    @staticmethod
    def request(s: StreamExecutor, params: GenParams) -> dict[str, Any]:
        return {"text": s.text_, "sampling_params": params.to_native(), **params.logprob_fields()}

    def generate(self, s: StreamExecutor, params: GenParams) -> GenResult:
        out = self._call(self.request(s, params))
        if isinstance(out, list):  # n > 1: one result per sample
            return [str(o["text"]) for o in out], [dict(o["meta_info"]) for o in out]
        return str(out["text"]), dict(out["meta_info"])

    def generate_stream(self, s: StreamExecutor, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        pos = 0
        for frame in self._call_stream({**self.request(s, params), "stream": True}):
            text = str(frame["text"])
            delta, pos = text[pos:], len(text)
            yield delta, dict(frame["meta_info"])

    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        if temperature > GREEDY_EPS:
            raise FeatureNotSupported("select: only greedy selection (temperature 0) is supported")
        prompt = s.text_
        prefix_meta = self.cache_prefix(prompt)
        prompt_len = int(prefix_meta["prompt_tokens"]) if prefix_meta else 0
        outs = self._call({
            "text": [prompt + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": max(prompt_len - 2, 0),
        })
        outs = outs if isinstance(outs, list) else [outs]
        input_lps: list[list[list[Any]]] = []
        for out in outs:
            entries = [list(e) for e in out["meta_info"]["input_token_logprobs"]]
            first_text = entries[0][2] if entries else None
            if len(entries) > 1 and isinstance(first_text, str) and prompt.endswith(first_text):
                entries = entries[1:]  # an unchanged prefix token, not part of the choice
            input_lps.append(entries)
        output_lps = [[list(e) for e in out["meta_info"].get("output_token_logprobs", [])] for out in outs]
        normalized = [mean_logprob(e) for e in input_lps]
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            ids = [[int(e[1]) for e in entries] for entries in input_lps]
            uncond = self._call({"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                 "return_logprob": True, "logprob_start_len": 0})
            uncond = uncond if isinstance(uncond, list) else [uncond]
            unconditional = [[list(e) for e in u["meta_info"]["input_token_logprobs"]] for u in uncond]
        return choices_method(choices=choices, normalized_prompt_logprobs=normalized,
                              input_token_logprobs=input_lps, output_token_logprobs=output_lps,
                              unconditional_token_logprobs=unconditional)
