"""A chat request rendered into prompt token ids — the one place that does it.

The server's /v1/chat/completions and the router's exact mode (which must predict the worker's tokens)
both call ``render_chat_request``, so their prompts cannot drift apart: message normalisation, tool
handling (template tools or the text fallback), generation-prompt options and template kwargs.
"""

from __future__ import annotations

from typing import Any

from runtime.http.openai_tools import ToolSetup, tool_setup
from runtime.http.protocol import ChatCompletionRequest
from runtime.models.tokenizer import apply_chat_template
from runtime.parsers.tool_formats import ToolCallFormat


def render_chat_request(tokenizer: Any, chat_template: str | None, tool_format: ToolCallFormat,
                        req: ChatCompletionRequest, completion: str | None = None) -> tuple[list[int], ToolSetup]:
    """Prompt ids of ``req`` (``chat_template``: an override of the tokenizer's). With ``completion``, the
    conversation as its next turn re-sends it: the answer appended as an assistant message."""
    messages = [m.template_dict() for m in req.messages]
    add_prompt, cont = req.add_generation_prompt, req.continue_final_message
    if completion is not None:
        messages.append({"role": "assistant", "content": completion})
        add_prompt, cont = False, False
    template_text = chat_template or getattr(tokenizer, "chat_template", None)
    setup = tool_setup(messages, req.tools, req.tool_choice, tool_format, template_text, req.parallel_tool_calls)
    ids = apply_chat_template(tokenizer, setup.messages, template=chat_template, add_generation_prompt=add_prompt,
                              continue_final_message=cont, **{**req.template_kwargs(), **setup.template_kwargs})
    return ids, setup
