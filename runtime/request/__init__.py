"""The caller's side of a request: turning an API call into single requests (``intake``), incremental
detokenization with stop strings (``decode_stream``) and the state a caller sees (``state``). Shared by the
server's tokenizer manager and detokenizer and by the in-process ``Engine``."""
