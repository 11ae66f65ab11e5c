"""BaseBackend: what the interpreter asks of a model backend.

A backend sees the executor (``s.text_``, ``s.messages_``) and resolved ``GenParams``; it returns text
plus a ``meta_info`` dict shaped like the native API's (``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``finish_reason`` where the backend knows them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from frontend.chat import ChatTemplate
from frontend.choices import ChoicesDecision, ChoicesSamplingMethod
from frontend.ir import GenParams

if TYPE_CHECKING:
    from frontend.interpreter import StreamExecutor


GenResult = tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]


class BackendError(RuntimeError):
    """A request the backend rejected or could not serve; ``status`` is the HTTP status when there was one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class FeatureNotSupported(BackendError):
    """The program uses something this backend (or the server behind it) cannot do."""


class BaseBackend:
    is_chat_model = False
    chat_template: ChatTemplate = ChatTemplate.chatml()

    def get_model_name(self) -> str:
        raise NotImplementedError

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # ------------------------------------------------------------------ prefix caching
    def cache_prefix(self, prefix_str: str) -> dict[str, Any] | None:
        """Prefill ``prefix_str`` without generating, so later requests that start with it hit the cache.
        Returns the request's ``meta_info`` where there is one; a no-op for backends without a cache."""
        return None

    def commit_lazy_operations(self, s: StreamExecutor) -> None:
        self.cache_prefix(s.text_)

    # ------------------------------------------------------------------ generation
    def generate(self, s: StreamExecutor, params: GenParams) -> GenResult:
        """(text, meta_info); with ``params.n`` > 1, one text and one meta_info per sample, as lists."""
        raise NotImplementedError

    def generate_stream(self, s: StreamExecutor, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """(new text, meta_info so far) pairs; the default generates at once and yields one piece."""
        text, meta = self.generate(s, params)
        if isinstance(text, list) or isinstance(meta, list):
            raise ValueError("gen: n > 1 samples cannot be streamed")
        yield text, meta

    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        raise NotImplementedError

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def end_program(self, s: StreamExecutor) -> None:
        """Called when a program state ends (nothing to release for stateless HTTP backends)."""

    def shutdown(self) -> None:
        """Release what the backend owns (connections, an in-process engine)."""
