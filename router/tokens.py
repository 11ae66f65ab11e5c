"""The router's tokenizer: the same token ids the worker will compute, for exact mode and token trees.

Exact mode compares a request's ids with each worker's real cache, so the ids must be the worker's:
plain prompts go through ``runtime.models.tokenizer.tokenize`` (special tokens added as the worker adds them) and
chat messages through ``runtime.models.tokenizer.apply_chat_template`` with the worker's template. The
tokenizer is loaded from a local folder: by default the ``tokenizer_path`` a worker reports in
``/get_model_info`` (true when the router runs on the workers' machine, as with ``serve --dp``); for
remote workers give ``--tokenizer``. The chat template is the one the worker reports, unless
``--chat-template`` names a file.

Chat requests are read with the worker's own request model (``runtime.http.protocol``) and rendered by
the worker's own function (``runtime.http.chat_render.render_chat_request``), tools included. A request
the router cannot tokenize (bad messages, a template error) gets ``None``: it is routed by load, and the
worker answers it with its own error.
"""

from __future__ import annotations

import logging
from typing import Any

from router.request_view import RequestView
from runtime.models.tokenizer import tokenize

logger = logging.getLogger(__name__)


class RequestTokenizer:
    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        from runtime.parsers.tool_formats import make_tool_format

        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tool_format = make_tool_format(None, chat_template or getattr(tokenizer, "chat_template", None))

    @classmethod
    def load(cls, path: str, chat_template: str | None = None) -> RequestTokenizer:
        from runtime.models.folders import load_tokenizer

        return cls(load_tokenizer(path), chat_template)

    def _chat_ids(self, view: RequestView, completion: str | None = None) -> list[int]:
        """The chat prompt exactly as the worker renders it (the same function renders both)."""
        from runtime.http.chat_render import render_chat_request
        from runtime.http.protocol import ChatCompletionRequest

        req = ChatCompletionRequest.model_validate(view.body)
        ids, _setup = render_chat_request(self.tokenizer, self.chat_template, self.tool_format, req,
                                           completion=completion)
        return ids

    def prompt_ids(self, view: RequestView) -> list[int] | None:
        """The prompt's token ids as the worker computes them (cached on the view)."""
        if view.tokens is not None:
            return view.tokens
        try:
            if view.input_ids is not None:
                view.tokens = list(view.input_ids)
            elif view.text is not None:
                view.tokens = tokenize(self.tokenizer, view.text)
            elif view.messages is not None:
                view.tokens = self._chat_ids(view)
        except Exception as exc:  # a bad request: the worker will say what is wrong
            logger.debug("cannot tokenize a request for routing: %s", exc)
            return None
        return view.tokens

    def ids_with_completion(self, view: RequestView, completion: str) -> list[int] | None:
        """Ids of the prompt followed by the answer, roughly what the worker caches after the request."""
        try:
            if view.text is not None:
                return tokenize(self.tokenizer, view.text + completion)
            if view.messages is not None:
                return self._chat_ids(view, completion)
        except Exception:
            return None
        return None
