"""EngineBackend: the runtime in-process (``runtime.engine.Engine``), through the same native requests.

``runtime.engine`` (and so torch) is imported only when an EngineBackend is created, keeping
``import frontend`` torch-free for thin clients.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from frontend.backends.base import BackendError
from frontend.backends.native import NativeBackend
from frontend.chat import ChatTemplate, resolve_chat_template


class EngineBackend(NativeBackend):
    def __init__(self, engine: Any = None, model: str | None = None,
                 chat_template: ChatTemplate | str | None = None, **engine_options: Any):
        """Wrap an existing ``Engine``, or start one: ``EngineBackend(model=PATH, max_total_tokens=...)``
        (``shutdown()`` then stops it)."""
        self._owns_engine = engine is None
        if engine is None:
            from runtime.engine import Engine

            engine = Engine(model=model or "default", **engine_options)
        self.engine = engine
        self.chat_template = resolve_chat_template(chat_template,
                                                   getattr(engine.tokenizer, "chat_template", None))

    def _generate(self, payload: dict[str, Any]) -> Any:
        try:
            return self.engine.generate(
                prompt=payload.get("text"), input_ids=payload.get("input_ids"),
                sampling_params=payload.get("sampling_params"),
                return_logprob=payload.get("return_logprob", False),
                logprob_start_len=payload.get("logprob_start_len"),
                top_logprobs_num=payload.get("top_logprobs_num"),
                return_text_in_logprobs=payload.get("return_text_in_logprobs", False),
                stream=payload.get("stream", False))
        except ValueError as exc:  # the Engine's "field: message" validation errors
            raise BackendError(str(exc), 400) from exc

    def _call(self, payload: dict[str, Any]) -> Any:
        return self._generate(payload)

    def _call_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self._generate(payload)

    def get_model_name(self) -> str:
        return str(self.engine.args.model)

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return dict(self.engine.server_info())

    def shutdown(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()
