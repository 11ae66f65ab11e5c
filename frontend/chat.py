"""Chat templates as role prefixes and suffixes, derived from the model's own Jinja template.

A program builds its prompt incrementally (``s += user(...)`` then ``s += assistant(gen(...))``), so
the interpreter needs, per role, the text that opens and closes a message -- not a function from a
whole conversation to text. ``ChatTemplate.from_jinja`` gets those by rendering the server's template
(``/get_model_info`` -> ``chat_template``) on probe conversations and diffing the results, so any model's
template works without a hand-written table. It also finds the default system prompt a template inserts
when the conversation does not start with one (SmolLM2's "You are a helpful AI assistant named SmolLM").

jinja2 is optional: the thin client install has none. Without it, ChatML-style templates (``<|im_start|>``)
are handled by the built-in ChatML renderer; anything else falls back to ChatML with a warning.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
_PROBE = "\u2063RADIXSERVE-CONTENT\u2063"  # content no real template alters or contains


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    source: str | None = field(default=None, compare=False, repr=False)

    def get_prefix_and_suffix(self, role: str, hist_messages: Sequence[dict[str, Any]] = ()) -> tuple[str, str]:
        """Text before and after a ``role`` message (the history is accepted for SGLang compatibility)."""
        try:
            return self.role_prefix_and_suffix[role]
        except KeyError:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(self.role_prefix_and_suffix)}") \
                from None

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """A whole conversation as text (the default system prompt inserted as the interpreter would)."""
        out = ""
        msgs = list(messages)
        if self.default_system_prompt and (not msgs or msgs[0]["role"] != "system"):
            msgs.insert(0, {"role": "system", "content": self.default_system_prompt})
        for m in msgs:
            prefix, suffix = self.get_prefix_and_suffix(m["role"])
            out += prefix + str(m["content"]) + suffix
        if add_generation_prompt:
            out += self.get_prefix_and_suffix("assistant")[0]
        return out

    # ------------------------------------------------------------------ construction
    @classmethod
    def chatml(cls, default_system_prompt: str | None = None) -> ChatTemplate:
        roles = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}
        return cls("chatml", roles, default_system_prompt, ("<|im_end|>",))

    @classmethod
    def plain(cls) -> ChatTemplate:
        """No markup at all: for base models and programs that write their own prompt format."""
        return cls("plain", {r: ("", "") for r in ROLES})

    @classmethod
    def from_jinja(cls, template: str | None, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """Derive prefixes/suffixes from a Jinja chat template; ChatML when there is none or it cannot be read.

        ``bos_token`` defaults to empty because the server's tokenizer adds BOS itself when the model
        wants one; rendering it here as well would double it.
        """
        if not template:
            return cls.chatml()
        try:
            import jinja2  # noqa: F401 - optional dependency
        except ImportError:
            return _without_jinja(template)
        try:
            return _derive(template, bos_token, eos_token)
        except Exception as exc:  # a template this probing cannot read: fall back, loudly
            logger.warning("could not derive role markers from the chat template (%s); using ChatML", exc)
            return cls.chatml()


def get_chat_template(name: str) -> ChatTemplate:
    """A built-in template by name: ``chatml`` or ``plain``."""
    if name == "chatml":
        return ChatTemplate.chatml()
    if name == "plain":
        return ChatTemplate.plain()
    raise ValueError(f"unknown chat template {name!r}; pass a ChatTemplate or a Jinja template string")


def resolve_chat_template(value: ChatTemplate | str | None, server_template: str | None) -> ChatTemplate:
    """A backend's template: an explicit ChatTemplate, a built-in name, a Jinja string, or the server's."""
    if isinstance(value, ChatTemplate):
        return value
    if isinstance(value, str):
        if "{" in value:
            return ChatTemplate.from_jinja(value)
        return get_chat_template(value)
    return ChatTemplate.from_jinja(server_template)


# ---------------------------------------------------------------------------- Jinja probing
def _renderer(template: str, bos_token: str, eos_token: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    compiled = env.from_string(template)

    def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return str(compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=bos_token, eos_token=eos_token))

    return render


def _segment(render: Any, history: list[dict[str, str]], role: str) -> tuple[str, str]:
    """The text one ``role`` message adds after ``history``, split around its content."""
    before = render(history)
    after = render([*history, {"role": role, "content": _PROBE}])
    if not after.startswith(before) or after.count(_PROBE) != 1:
        raise ValueError(f"the {role} message changes the text before it")
    prefix, suffix = after[len(before):].split(_PROBE)
    return prefix, suffix


def _system_segment(render: Any, user: tuple[str, str]) -> tuple[str, str]:
    """The system message's markers: alone if the template renders a lone system message; else from
    what precedes a user turn (templates that read ``messages[0]`` unconditionally cannot render an
    empty history); else a user turn's (templates without a system role, e.g. Gemma)."""
    try:
        return _segment(render, [], "system")
    except Exception:
        pass
    try:
        full = render([{"role": "system", "content": _PROBE}, {"role": "user", "content": "U"}])
        tail = user[0] + "U" + user[1]
        head = full[: -len(tail)] if full.endswith(tail) else ""
        if head.count(_PROBE) == 1:
            prefix, suffix = head.split(_PROBE)
            return prefix, suffix
    except Exception:
        pass
    return user


def _derive(template: str, bos_token: str, eos_token: str) -> ChatTemplate:
    render = _renderer(template, bos_token, eos_token)
    sys_msg = {"role": "system", "content": "S"}
    user_msg = {"role": "user", "content": "U"}
    roles = {
        "user": _segment(render, [sys_msg], "user"),
        "assistant": _segment(render, [sys_msg, user_msg], "assistant"),
    }
    roles["system"] = _system_segment(render, roles["user"])
    # A template that inserts a system message when none is given shows it in front of a lone user turn.
    default_system = None
    lone = render([{"role": "user", "content": _PROBE}])
    u_prefix, u_suffix = roles["user"]
    head = lone[: lone.find(u_prefix + _PROBE)] if u_prefix + _PROBE in lone else ""
    s_prefix, s_suffix = roles["system"]
    if head and head.startswith(s_prefix) and head.endswith(s_suffix) and len(head) > len(s_prefix + s_suffix):
        default_system = head[len(s_prefix): len(head) - len(s_suffix)]
    a_suffix = roles["assistant"][1].strip()
    stop = (a_suffix,) if a_suffix else ()
    name = "chatml" if roles["user"][0].startswith("<|im_start|>") else "jinja"
    return ChatTemplate(name, roles, default_system, stop, source=template)


def _without_jinja(template: str) -> ChatTemplate:
    if "<|im_start|>" not in template:
        logger.warning("jinja2 is not installed and the chat template is not ChatML; using ChatML "
                       "(pip install jinja2 to use the model's own template)")
        return ChatTemplate.chatml()
    # The default system prompt is the literal system message text in the template source, if any.
    for m in re.finditer(r"<\|im_start\|>system(?:\\n|\n)(.*?)<\|im_end\|>", template, re.S):
        text = m.group(1)
        if not any(c in text for c in "'\"{}+"):  # a literal, not an expression like messages[0]
            return ChatTemplate.chatml(text.replace("\\n", "\n"))
    return ChatTemplate.chatml()
