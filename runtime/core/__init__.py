"""Types every layer shares: the batch a forward pass runs (``forward_batch``), sampling parameters and stop
rules (``sampling_params``, ``stop_regex``) and the typed messages between the processes (``messages``).
Imports nothing of runtime/ but its own modules (and radix/)."""
