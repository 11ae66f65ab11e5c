"""How ``select`` turns per-token logprobs of each choice into a decision (SGLang's three methods).

Every method receives, per choice, the scored token entries ``[logprob, token_id, text]`` (the prompt
tokens from the boundary on, see ``backends/native.py``) and their mean (``normalized_prompt_logprobs``).

- ``token_length_normalized`` (default): the highest mean token logprob; longer choices are not
  penalised for having more tokens.
- ``greedy_token_selection``: compare token by token, keeping the choices tied for the best logprob at
  each position; a shorter choice is padded with its own mean so it can still be compared.
- ``unconditional_likelihood_normalized``: mean of (conditional - unconditional) token logprobs, where
  the unconditional ones score the same tokens without the prompt; favours choices the context makes
  likely over choices that are likely anyway.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


def mean_logprob(entries: list[list[Any]]) -> float:
    """Mean of the entries' logprobs, skipping ``None`` (the first prompt token has none); -inf if empty."""
    values = [e[0] for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else -math.inf


def _argmax_first(values: list[float]) -> int:
    """Index of the largest value; the first one on ties (so equal scores pick the earlier choice)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[list[Any]]], output_token_logprobs: list[list[list[Any]]],
                 unconditional_token_logprobs: list[list[list[Any]]] | None = None) -> ChoicesDecision: ...


class TokenLengthNormalized(ChoicesSamplingMethod):
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[list[Any]]], output_token_logprobs: list[list[list[Any]]],
                 unconditional_token_logprobs: list[list[list[Any]]] | None = None) -> ChoicesDecision:
        best = _argmax_first(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        })


class GreedyTokenSelection(ChoicesSamplingMethod):
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[list[Any]]], output_token_logprobs: list[list[list[Any]]],
                 unconditional_token_logprobs: list[list[list[Any]]] | None = None) -> ChoicesDecision:
        width = max(len(entries) for entries in input_token_logprobs)
        matrix: list[list[float]] = []
        for entries in input_token_logprobs:
            row = [e[0] if e[0] is not None else 0.0 for e in entries]
            pad = sum(row) / len(row) if row else -math.inf
            matrix.append(row + [pad] * (width - len(row)))
        alive = list(range(len(choices)))
        for j in range(width):
            top = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == top]
            if len(alive) == 1:
                break
        return ChoicesDecision(choices[alive[0]], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "greedy_logprob_matrix": matrix,
        })


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[list[Any]]], output_token_logprobs: list[list[list[Any]]],
                 unconditional_token_logprobs: list[list[list[Any]]] | None = None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional token logprobs")
        scores: list[float] = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs, strict=True):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional logprobs cover different token counts")
            # The unconditional sequence starts fresh, so its first token has no logprob: count it as 0.
            diffs = [(c[0] or 0.0) - (u[0] or 0.0) for c, u in zip(cond, uncond)]
            scores.append(sum(diffs) / len(diffs) if diffs else -math.inf)
        best = _argmax_first(scores)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": scores,
        })


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
