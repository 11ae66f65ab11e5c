"""Speculative decoding: drafts proposed by a drafter (``drafter``: the interface) — n-gram drafts from the
request's own tokens and from the sequences the server finished (``ngram``), or a smaller draft model decoding
ahead greedily (``model_drafter``, over ``runtime.executor.draft_model``) — verified by the served model in one
forward (``verify``), with a per-request draft length that backs off when drafts are rejected (``adaptive``).

The package knows token sequences, sampling rows and the draft model, not the scheduler:
``runtime.scheduler.speculation`` wires it into the step (which requests draft, their KV slots, the verify rows,
what is emitted).
"""
