"""A chat conversation rendered into prompt token ids, tools included — the one place that does it.

The server's /v1/chat/completions and /v1/responses, and the router's exact mode (which must predict the
worker's tokens), all render through ``render_messages``, so their prompts cannot drift apart: tool handling,
generation-prompt options and template kwargs.

Tools (``tool_setup``): validates ``tools`` / ``tool_choice``, renders them through the chat template when
it knows tools (else describes them in the system message in the model's call format and renders earlier
calls and tool results as text), and picks the grammar: ``required`` and a named function constrain the
whole answer to calls; ``auto`` leaves text free but constrains every call the model opens, so an ``auto``
call is valid too. Reading calls back out of the answer is ``runtime.parsers.output``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from runtime.http.errors import APIError
from runtime.http.protocol import ChatCompletionRequest
from runtime.models.tokenizer import apply_chat_template
from runtime.parsers.tool_formats import ToolCall, ToolCallFormat, check_tools, template_supports_tools


def render_chat_request(tokenizer: Any, chat_template: str | None, tool_format: ToolCallFormat,
                        req: ChatCompletionRequest, prompt_field: str = "messages",
                        completion: str | None = None) -> tuple[list[int], ToolSetup]:
    """Prompt ids of ``req`` (``chat_template``: an override of the tokenizer's). With ``completion``, the
    conversation as its next turn re-sends it: the answer appended as an assistant message.
    ``prompt_field``: what the calling API names the conversation, in errors."""
    messages = [m.template_dict() for m in req.messages]
    add_prompt, cont = req.add_generation_prompt, req.continue_final_message
    if completion is not None:
        messages.append({"role": "assistant", "content": completion})
        add_prompt, cont = False, False
    return render_messages(tokenizer, chat_template, tool_format, messages, req.tools, req.tool_choice,
                           req.parallel_tool_calls, add_generation_prompt=add_prompt, continue_final_message=cont,
                           template_kwargs=req.template_kwargs(), prompt_field=prompt_field)


def render_messages(tokenizer: Any, chat_template: str | None, tool_format: ToolCallFormat,
                    messages: list[dict[str, Any]], tools: list[Any] | None, tool_choice: Any, parallel: bool,
                    *, add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None,
                    prompt_field: str = "messages") -> tuple[list[int], ToolSetup]:
    """Prompt ids of ``messages`` (as the template sees them) with ``tools``."""
    template_text = chat_template or getattr(tokenizer, "chat_template", None)
    setup = tool_setup(messages, tools, tool_choice, tool_format, template_text, parallel, prompt_field)
    ids = apply_chat_template(tokenizer, setup.messages, template=chat_template,
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message,
                              **{**(template_kwargs or {}), **setup.template_kwargs})
    return ids, setup


def template_failure(exc: Exception, prompt_field: str) -> APIError:
    """What the chat template raised, as the 400 it is: the template is the model's, so what fails in it
    is the request's messages."""
    if isinstance(exc, APIError):
        return exc
    message = str(exc)
    if not message.startswith(prompt_field):
        message = f"{prompt_field}: the chat template failed: {message}"
    return APIError(400, message, prompt_field)


def one_grammar(grammars: dict[str, object], field: str, names: str) -> None:
    """At most one way of constraining the output: ``grammars`` maps each way to its grammar (None: not
    asked for); more than one is a 400 naming ``field`` and listing ``names``."""
    if sum(g is not None for g in grammars.values()) > 1:
        raise APIError(400, f"{field}: give only one of {names}", field)


@dataclass
class ToolSetup:
    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    structural_tag: str | None = None
    parse_calls: bool = False


def _choice(tool_choice: Any, names: list[str]) -> str:
    if tool_choice is None:
        return "auto" if names else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not names:
            raise APIError(400, f"tool_choice: {tool_choice!r} needs tools", "tool_choice")
        return str(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise APIError(400, f"tool_choice: no tool named {name!r} in tools", "tool_choice")
        return str(name)
    raise APIError(400, "tool_choice: must be 'none', 'auto', 'required' or "
                   "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def _as_calls(raw: list[dict[str, Any]]) -> list[ToolCall]:
    calls = []
    for c in raw:
        fn = c.get("function") or {}
        args = fn.get("arguments", "{}")
        calls.append(ToolCall(str(fn.get("name", "")), args if isinstance(args, str) else json.dumps(args),
                              str(c.get("id", ""))))
    return calls


def tool_setup(messages: list[dict[str, Any]], tools: list[Any] | None, tool_choice: Any,
               fmt: ToolCallFormat, chat_template: str | None, parallel: bool = True,
               prompt_field: str = "messages") -> ToolSetup:
    """The messages and template arguments that carry ``tools``, and the grammar ``tool_choice`` asks for.
    ``prompt_field``: what the calling API names the conversation, in errors."""
    try:
        specs = check_tools(tools or [])
    except ValueError as exc:
        raise APIError(400, str(exc), "tools") from None
    choice = _choice(tool_choice, [t["name"] for t in specs])
    has_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not specs and not has_history:
        return ToolSetup(messages)
    setup = ToolSetup(list(messages), parse_calls=choice != "none")
    if template_supports_tools(chat_template):
        if specs:
            setup.template_kwargs["tools"] = tools
        for m in setup.messages:  # templates expect arguments as objects, OpenAI sends strings
            for c in m.get("tool_calls") or []:
                args = (c.get("function") or {}).get("arguments")
                if isinstance(args, str):
                    try:
                        c["function"] = {**c["function"], "arguments": json.loads(args)}
                    except ValueError:
                        raise APIError(400, f"{prompt_field}: tool_calls arguments must be JSON",
                                       prompt_field) from None
    else:
        setup.messages = _render_as_text(setup.messages, specs, fmt)
    if choice != "none" and specs:
        setup.structural_tag = fmt.structural_tag(specs, choice, parallel)
    return setup


def _render_as_text(messages: list[dict[str, Any]], specs: list[dict[str, Any]],
                    fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """For templates without tool support: tools described in the system message, calls and results as
    ordinary text in assistant and user turns, written exactly as the model writes them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(fmt.render_call(c) for c in _as_calls(m.pop("tool_calls")))
            m["content"] = (m.get("content") or "") + calls
        if m.get("role") == "tool":
            m = {"role": "user", "content": fmt.render_result(m.get("content") or "", m.get("name"))}
        out.append(m)
    if specs:
        text = fmt.instructions(specs)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
