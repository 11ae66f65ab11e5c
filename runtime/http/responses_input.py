"""The input side of ``/v1/responses``, as pure functions: items, tools and formats in chat's shapes.

``input_items`` checks and normalises the request's ``input`` (a string, or message / function_call /
function_call_output items) into the form the store keeps; ``chat_messages`` turns a whole conversation
of such items into chat messages for the chat template. Errors name the offending item
(``input.2.content.0``).
"""

from __future__ import annotations

from typing import Any

from runtime.http.errors import APIError
from runtime.parsers.tool_formats import check_functions


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """Message content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise APIError(400, f"{where}.{j}: only text content parts ({', '.join(kinds)}) are supported, "
                           f"got {kind!r}", f"{where}.{j}")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.{j}.text: must be a string", f"{where}.{j}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key}: must be a string", f"{where}.{key}")
    return value


def input_items(raw: Any) -> list[dict[str, Any]]:
    """``input`` as normalised items: messages with string content, function calls, their outputs.
    Reasoning items a client sends back are dropped (the chat template would drop them too)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "input: must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role: must be 'user', 'system', 'developer' or 'assistant', "
                               f"got {role!r}", f"{where}.role")
            kinds = ("output_text", "input_text") if role == "assistant" else ("input_text",)
            out.append({"type": "message", "role": role,
                        "content": _text_of(item.get("content"), f"{where}.content", kinds)})
        elif kind == "function_call":
            out.append({"type": "function_call", "call_id": _string(item, "call_id", where),
                        "name": _string(item, "name", where), "arguments": _string(item, "arguments", where)})
        elif kind == "function_call_output":
            out.append({"type": "function_call_output", "call_id": _string(item, "call_id", where),
                        "output": _text_of(item.get("output"), f"{where}.output", ("input_text",))})
        elif kind != "reasoning":
            raise APIError(400, f"{where}.type: items of type {kind!r} are not supported; use messages, "
                           "function_call and function_call_output items", f"{where}.type")
    return out


def stored_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the input items of the next turn."""
    items = []
    for it in output:
        if it["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": it["content"][0]["text"]})
        elif it["type"] == "function_call":
            items.append({k: it[k] for k in ("type", "call_id", "name", "arguments")})
    return items


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The conversation as chat messages: calls join the assistant message before them, outputs become
    tool messages (named after their call)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}
    for it in items:
        if it["type"] == "message":
            messages.append({"role": it["role"], "content": it["content"]})
        elif it["type"] == "function_call":
            names[it["call_id"]] = it["name"]
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            name = names.get(it["call_id"])
            if name is None:
                raise APIError(400, f"input: no function_call with call_id {it['call_id']!r} precedes its "
                               "function_call_output in the conversation", "input")
            messages.append({"role": "tool", "tool_call_id": it["call_id"], "name": name,
                             "content": it["output"]})
    return messages


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Function tools (``{"type": "function", "name", "description", "parameters"}``) in chat shape,
    checked here so that an error names the field as this request holds it (``tools.0.name``)."""
    functions: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise APIError(400, f"tools.{i}.type: only function tools are supported, got {kind!r}",
                           f"tools.{i}.type")
        functions.append({k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None})
    try:
        check_functions([(fn, f"tools.{i}") for i, fn in enumerate(functions)])
    except ValueError as exc:
        raise APIError(400, str(exc), "tools") from None
    return [{"type": "function", "function": fn} for fn in functions]


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                   "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if not text:
        return None
    extra = set(text) - {"format"}
    if extra:
        raise APIError(400, f"text.{sorted(extra)[0]}: not supported", f"text.{sorted(extra)[0]}")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format.schema: a json_schema format needs a schema (an object)",
                           "text.format.schema")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "description", "schema",
                                                                            "strict") if k in fmt}}
    raise APIError(400, "text.format.type: must be 'text', 'json_object' or 'json_schema'", "text.format.type")


def check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > 16:
        raise APIError(400, f"metadata: at most 16 pairs, got {len(metadata)}", "metadata")
    for k, v in metadata.items():
        if len(k) > 64 or len(v) > 512:
            raise APIError(400, f"metadata.{k[:64]}: keys are at most 64 characters and values 512",
                           "metadata")
