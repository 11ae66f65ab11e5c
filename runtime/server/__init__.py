"""The server's processes and their plumbing: the main process's tokenizer manager, the scheduler process,
the detokenizer process, ZMQ endpoints and codec (``ipc``), the hang watchdog, the KV-event publisher and the
scheduler's read-only dashboard queries. ``runtime.launch`` starts them; ``runtime.http`` serves them."""
