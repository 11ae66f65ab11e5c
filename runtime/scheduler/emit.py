"""From a request's sampled tokens to its output: the one path every decode and completed prefill takes.

A request sampled at ``1 + len(draft)`` rows (a draft being verified, ``runtime.scheduler.speculation``; no
draft: one row) emits the token of each row while the draft agreed with what was sampled before it
(``runtime.speculative.verify``), and after each token the checks a decode always makes: the grammar accepts
it, its logprobs are kept, the stop conditions (stop tokens, EOS, ``max_new_tokens``, context length, stop
strings and regexes). The first finish ends the emission: no token after a stop is ever output.
"""

from __future__ import annotations

from runtime.core.messages import AbortCause, FinishReason
from runtime.executor.sampler import SampleResult
from runtime.scheduler.req import Req
from runtime.scheduler.stop import StopChecker
from runtime.speculative.verify import accepted_length


def emit_tokens(req: Req, sampled: SampleResult, row: int, draft: list[int],
                stop: StopChecker) -> tuple[FinishReason | None, int]:
    """Apply the tokens sampled for ``req`` at rows ``row ..``; returns the finish (None: it goes on) and how
    many tokens were emitted."""
    ids = sampled.token_ids
    n = accepted_length(draft, ids[row : row + len(draft) + 1]) + 1
    for j in range(n):
        token = ids[row + j]
        req.append_token(token)
        if req.grammar is not None and not req.grammar.accept_token(token):
            return FinishReason("abort", message=f"token {token} violates the grammar", cause=AbortCause.ERROR), j + 1
        if req.return_logprob:
            lp = sampled.logprobs[row + j]
            req.pending_output_logprobs.append((float(lp) if lp is not None else 0.0, token))
            if req.top_logprobs_num:
                req.pending_output_top.append(sampled.top_logprobs[row + j] or [])
        finish = stop.check(req)
        if finish is not None:
            return finish, j + 1
    return None, n
