"""Workload files: reading and writing the workload structures of ``workloads.py`` as JSON / JSONL.

Workload files (``radixserve bench run --workload-file PATH``; ``radixserve bench workload NAME --out PATH``
writes one from a generator) hold the same structures:

- ``*.jsonl``: one item per line (blank lines are skipped);
- any other name: JSON, either a workload object (``{"name"?, "description"?, "requests": [...]}`` or
  ``{... "sessions": [...]}``) or a list of items.

An item is a request ``{"id"?, "endpoint"?, "body": {...}}``, a session ``{"id"?, "messages"?, "steps":
[...]}``, or, as a shorthand, a bare request body (``{"prompt": ..., "max_tokens": 8}`` or
``{"messages": [...], ...}``). ``endpoint`` defaults to what the body holds (``prompt``: completions,
``messages``: chat); ids default to ``<name>-<index>``; ``model``, ``stream`` and ``stream_options`` are
dropped (the client sets them). All items of one file are requests, or all are sessions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_CLIENT_FIELDS = ("model", "stream", "stream_options")


def _clean_body(body: Any, where: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValueError(f"{where}: a request body must be a JSON object, got {type(body).__name__}")
    return {k: v for k, v in body.items() if k not in _CLIENT_FIELDS}


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages):
        raise ValueError(f"{where}: messages must be a list of {{\"role\": ..., \"content\": ...}} objects")
    return messages


def _request(item: dict[str, Any], index: int, name: str, where: str) -> dict[str, Any]:
    wrapped = "body" in item  # {"id"?, "endpoint"?, "body": {...}}, or the body itself
    body = _clean_body(item.get("body", item), where)
    endpoint = item.get("endpoint") if wrapped else None
    if endpoint is None:
        if "prompt" in body:
            endpoint = "completions"
        elif "messages" in body:
            endpoint = "chat"
        else:
            raise ValueError(f"{where}: a request body needs \"prompt\" (completions) or \"messages\" (chat)")
    if endpoint == "completions":
        if not isinstance(body.get("prompt"), str):
            raise ValueError(f"{where}: a completions request needs a string \"prompt\"")
    elif endpoint == "chat":
        _check_messages(body.get("messages"), where)
    else:
        raise ValueError(f"{where}: endpoint must be \"completions\" or \"chat\", got {endpoint!r}")
    return {"id": str(item.get("id", f"{name}-{index:03d}")) if wrapped else f"{name}-{index:03d}",
            "endpoint": endpoint, "body": body}


def _session(item: dict[str, Any], index: int, name: str, where: str) -> dict[str, Any]:
    if item.get("endpoint", "chat") != "chat":
        raise ValueError(f"{where}: sessions are chats; endpoint must be \"chat\"")
    steps = item["steps"]
    if not isinstance(steps, list) or not steps:
        raise ValueError(f"{where}: \"steps\" must be a non-empty list")
    out_steps = []
    for j, step in enumerate(steps):
        at = f"{where}, step {j}"
        if not isinstance(step, dict):
            raise ValueError(f"{at}: a step must be a JSON object")
        body = _clean_body(step.get("body", {}), at)
        if "messages" in body or "prompt" in body:
            raise ValueError(f"{at}: a step body takes no messages/prompt (they come from the history)")
        out_steps.append({"append": _check_messages(step.get("append", []), at), "body": body})
    return {"id": str(item.get("id", f"{name}-{index:03d}")), "endpoint": "chat",
            "messages": _check_messages(item.get("messages", []), where), "steps": out_steps}


def from_items(items: list[Any], name: str, description: str | None = None, source: str = "",
               where: str = "") -> dict[str, Any]:
    """A workload from a list of requests, sessions or bare request bodies (see the module docstring)."""
    if not items:
        raise ValueError(f"{where or name}: no requests")
    kinds = set()
    normal = []
    for i, item in enumerate(items):
        at = f"{where or name}: item {i}" if not isinstance(item, tuple) else f"{where}:{item[0]}"
        obj = item[1] if isinstance(item, tuple) else item  # (line number, object) from a JSONL file
        if not isinstance(obj, dict):
            raise ValueError(f"{at}: expected a JSON object, got {type(obj).__name__}")
        if "steps" in obj:
            kinds.add("sessions")
            normal.append(_session(obj, i, name, at))
        else:
            kinds.add("independent")
            normal.append(_request(obj, i, name, at))
    if len(kinds) > 1:
        raise ValueError(f"{where or name}: mixes sessions (items with \"steps\") and independent requests")
    kind = kinds.pop()
    key = "sessions" if kind == "sessions" else "requests"
    ids = [x["id"] for x in normal]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where or name}: duplicate ids")
    if description is None:
        description = (f"{len(normal)} sessions ({sum(len(s['steps']) for s in normal)} requests)"
                       if kind == "sessions" else f"{len(normal)} requests")
        description += f" from {source or name}"
    return {"name": name, "kind": kind, "source": source or name, "description": description,
            "params": {"file": source or name, key: len(normal)}, key: normal}


def load_workload_file(path: str | Path) -> dict[str, Any]:
    """Read a workload file (JSON or, for ``*.jsonl``, JSON Lines); ``ValueError`` names what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    name, description = path.stem, None
    items: list[Any]
    if path.suffix == ".jsonl":
        items = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append((lineno, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path.name}:{lineno}: not JSON ({exc.msg})") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path.name}: not JSON ({exc.msg} at line {exc.lineno})") from exc
        if isinstance(data, dict) and ("requests" in data or "sessions" in data):
            if "requests" in data and "sessions" in data:
                raise ValueError(f"{path.name}: has both \"requests\" and \"sessions\"")
            listed = data["requests"] if "requests" in data else data["sessions"]
            if not isinstance(listed, list):
                raise ValueError(f"{path.name}: \"requests\"/\"sessions\" must be a list")
            items = listed
            name = str(data.get("name", name))
            description = data.get("description")
            declared = data.get("kind")
            wl = from_items(items, name, description, path.name, path.name)
            if declared is not None and declared != wl["kind"]:
                raise ValueError(f"{path.name}: kind is {declared!r} but the items are {wl['kind']}")
            return wl
        if isinstance(data, list):
            items = data
        elif isinstance(data, dict):
            items = [data]
        else:
            raise ValueError(f"{path.name}: expected a workload object or a list of requests")
    return from_items(items, name, description, path.name, path.name)


def dump_workload(wl: dict[str, Any], path: str | Path) -> Path:
    """Write ``wl`` so that ``load_workload_file`` reads the same requests back (``*.jsonl``: one item a
    line; otherwise one JSON object)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = "sessions" if wl["kind"] == "sessions" else "requests"
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in wl[key]), encoding="utf-8")
    else:
        obj = {"name": wl["name"], "kind": wl["kind"], "description": wl.get("description", ""),
               "params": wl.get("params", {}), key: wl[key]}
        path.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return path


def workload_sizes(wl: dict[str, Any]) -> str:
    """One line: how many requests and how long the prompts are (characters; no tokenizer needed)."""
    if wl["kind"] == "independent":
        reqs = wl["requests"]
        lens = [len(r["body"]["prompt"]) if r["endpoint"] == "completions"
                else sum(len(str(m["content"])) for m in r["body"]["messages"]) for r in reqs]
        seqs = sum(max(int(r["body"].get("n", 1) or 1), 1) for r in reqs)
        return (f"{wl['name']}: {len(reqs)} requests ({seqs} sequences), prompt characters min/mean/max "
                f"{min(lens)}/{sum(lens) / len(lens):.0f}/{max(lens)}")
    sess = wl["sessions"]
    first = [sum(len(str(m["content"])) for m in s["messages"] + s["steps"][0]["append"]) for s in sess]
    return (f"{wl['name']}: {len(sess)} sessions, {sum(len(s['steps']) for s in sess)} requests, first-step "
            f"prompt characters min/mean/max {min(first)}/{sum(first) / len(first):.0f}/{max(first)} "
            "(the history grows by the answers)")
