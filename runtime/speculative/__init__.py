"""Speculative decoding without a second model: drafts proposed by a drafter (``drafter``: the interface) —
n-gram drafts from the request's own tokens and from the sequences the server finished (``ngram``) — verified by
the target model in one forward (``verify``), with a per-request draft length that backs off when drafts are
rejected (``adaptive``).

The package knows token sequences and sampling rows, not the scheduler: ``runtime.scheduler.speculation`` wires
it into the step (which requests draft, their KV slots, the verify rows, what is emitted).
"""
