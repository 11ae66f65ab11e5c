"""SamplingParams: how one request's tokens are chosen and when it stops (SGLang's field names).

``from_dict`` accepts exactly SGLang's ``sampling_params`` object (every field of the current SGLang
release; ``null`` means the default, as SGLang's clients send it) and runs ``validate``, which raises
ValueError naming the offending field: every API's ranges are checked there, once (the HTTP models only
publish them in their schemas). ``check_token_ids`` is the part that needs the vocabulary, run by the
intake when the request is prepared (``runtime.request.intake.check``).
Fields of features this server does not have (beam search, watermarking, ``choice``) are accepted at their
defaults and refused with a 400 naming them otherwise; ``custom_params`` is accepted and never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from runtime.core import stop_regex as stop_regex_mod

GREEDY_EPS = 1e-6
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
MAX_STOP_STRINGS = 32  # SGLang's limit
TOP_K_ALL = 1 << 30  # SGLang's spelling of "no top-k cut", sent by its clients as the default


def _watermark_off(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and not value.get("enabled") and not value.get("key"))


# SGLang fields of features this server does not have: (is the value the "off" default?, why refused).
ABSENT_FEATURES: dict[str, tuple[Any, str]] = {
    "beam_width": (lambda v: v is None or (v == 1 and not isinstance(v, bool)), "beam search is not supported"),
    "watermark": (_watermark_off, "watermarking is not supported"),
    "choice": (lambda v: v is None or v == [], "choice-constrained decoding is not supported; use regex"),
}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)  # stop at the first non-empty match (stop_regex.py)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # Native SSE streams send a frame per this many new tokens (the final frame always); None: every step.
    stream_interval: int | None = None
    # Accepted so SGLang clients that set it work; nothing here reads it (no custom logit processors).
    custom_params: dict[str, Any] | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        aliases = {"sampling_seed": "seed", "max_tokens": "max_new_tokens"}
        for old, new in aliases.items():
            if old in d and new not in d:
                d[new] = d.pop(old)
            else:
                d.pop(old, None)
        for name, (is_off, why) in ABSENT_FEATURES.items():
            if name in d and not is_off(d.pop(name)):
                raise ValueError(f"{name}: {why}")
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}")
        d = {k: v for k, v in d.items() if v is not None}
        for name in ("stop", "stop_regex"):
            if isinstance(d.get(name), str):
                d[name] = [d[name]]
        for kind in GRAMMAR_KINDS:  # SGLang: an empty grammar means "unset", not "constrain to nothing"
            if d.get(kind) == "":
                del d[kind]
        if isinstance(d.get("top_k"), int) and d["top_k"] >= TOP_K_ALL:
            d["top_k"] = -1
        if isinstance(d.get("stop_token_ids"), int):
            d["stop_token_ids"] = [d["stop_token_ids"]]
        for kind in ("json_schema", "structural_tag"):
            if isinstance(d.get(kind), dict):
                import json

                d[kind] = json.dumps(d[kind])
        params = cls(**d)
        params.validate()
        return params

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {msg}")

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens",
             f"must be an integer >= 0, got {self.max_new_tokens!r}")
        need(is_int(self.min_new_tokens) and self.min_new_tokens >= 0, "min_new_tokens",
             f"must be an integer >= 0, got {self.min_new_tokens!r}")
        need(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
             f"({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})")
        need(is_num(self.temperature) and self.temperature >= 0, "temperature",
             f"must be a number >= 0, got {self.temperature!r}")
        need(self.temperature <= 100, "temperature", f"must be at most 100, got {self.temperature!r}")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        need(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
             f"must be -1 (off) or >= 1, got {self.top_k!r}")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        need(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"must be in [-2, 2], got {self.frequency_penalty!r}")
        need(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             f"must be in [-2, 2], got {self.presence_penalty!r}")
        need(is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2, "repetition_penalty",
             f"must be in (0, 2], got {self.repetition_penalty!r}")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
             "must be a non-empty string or a list of non-empty strings")
        need(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        need(isinstance(self.stop_regex, list), "stop_regex", "must be a string or a list of strings")
        stop_regex_mod.check_patterns(self.stop_regex)
        need(self.stream_interval is None or (is_int(self.stream_interval) and self.stream_interval >= 1),
             "stream_interval", f"must be an integer >= 1, got {self.stream_interval!r}")
        need(self.custom_params is None or isinstance(self.custom_params, dict), "custom_params",
             "must be an object")
        need(isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "must be a list of token ids")
        need(is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        need(self.seed is None or is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        need(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to biases")
        try:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        except (TypeError, ValueError):
            raise ValueError("logit_bias: keys must be token ids and values numbers") from None
        need(all(-100 <= v <= 100 for v in self.logit_bias.values()), "logit_bias",
             "biases must be in [-100, 100]")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            need(isinstance(getattr(self, name), bool), name, "must be a boolean")
        grammars = [g for g in GRAMMAR_KINDS if getattr(self, g) is not None]
        need(len(grammars) <= 1, grammars[-1] if grammars else "json_schema",
             f"only one of json_schema, regex, ebnf and structural_tag may be given, got {grammars}")
        for g in grammars:
            need(isinstance(getattr(self, g), str), g, "must be a string")

    def check_token_ids(self, vocab_size: int) -> None:
        """The token ids of ``logit_bias`` and ``stop_token_ids`` are in the vocabulary (after ``validate``)."""
        bad = [t for t in list(self.logit_bias) + self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            name = "logit_bias" if any(t in self.logit_bias for t in bad) else "stop_token_ids"
            raise ValueError(f"{name}: token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")

    # ------------------------------------------------------------------ derived
    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar constraint, if any."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None
