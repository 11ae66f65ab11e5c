"""When a request is done: stop tokens, end of sequence, length limits, stop strings, stop regexes,
grammar end.

Stop strings are checked on the decoded tail of the output (just long enough to hold the longest stop
string), so a string split across several tokens is still caught; stop regexes likewise, on a tail as long
as the longest text a pattern can match, or on the whole output for patterns with no such bound
(``runtime/core/stop_regex.py``). The text itself is trimmed later by the detokenizer.
"""

from __future__ import annotations

from typing import Any

from runtime.core import stop_regex
from runtime.core.messages import FinishReason
from runtime.scheduler.req import Req

TAIL_SLACK_TOKENS = 4
# A character can take several byte-level tokens (a UTF-8 sequence split across tokens).
TOKENS_PER_CHAR = 2


class StopChecker:
    def __init__(self, tokenizer: Any, context_length: int):
        self.tokenizer = tokenizer
        self.context_length = context_length

    def check(self, req: Req) -> FinishReason | None:
        sp = req.sampling
        n = len(req.output_ids)
        last = req.output_ids[-1]
        may_stop = n >= sp.min_new_tokens
        if may_stop and (last in sp.stop_token_ids or (not sp.ignore_eos and last in req.eos_ids)):
            return FinishReason("stop", matched=last)
        if req.grammar is not None and req.grammar.is_terminated():
            return FinishReason("stop", matched=None)
        if req.tokens_left(self.context_length) == 0:
            return FinishReason("length", length=n)
        if sp.stop and may_stop:
            longest = max(len(s) for s in sp.stop)
            tail_ids = req.output_ids[-(longest + TAIL_SLACK_TOKENS) :]
            tail = self.tokenizer.decode(tail_ids, skip_special_tokens=sp.skip_special_tokens)
            for s in sp.stop:
                if s in tail:
                    return FinishReason("stop", matched=s)
        if sp.stop_regex and may_stop:
            return self._check_regex(req)
        return None

    def _check_regex(self, req: Req) -> FinishReason | None:
        sp = req.sampling
        bounds = [stop_regex.tail_chars(p) for p in sp.stop_regex]
        if any(b is None for b in bounds):
            ids = req.output_ids  # an unbounded pattern: its match may begin anywhere in the output
        else:
            longest = max(b for b in bounds if b is not None)
            ids = req.output_ids[-(longest * TOKENS_PER_CHAR + TAIL_SLACK_TOKENS) :]
        text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
        found = stop_regex.first_match(sp.stop_regex, text)
        return FinishReason("stop", matched=found[0]) if found else None
