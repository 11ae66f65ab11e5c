"""The dashboard's node previews: decoded text equals the tokenizer's, and a polled tree is decoded only once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.http.dashboard import PreviewTexts
from runtime.models.folders import load_tokenizer


def _tree(tok: Any) -> dict[str, Any]:
    ids_a = tok("You are a helpful assistant. Answer briefly.").input_ids
    ids_b = tok("Example 1: two plus two is four.").input_ids
    return {"nodes": [
        {"id": 0, "tokens": 0, "label": "root", "preview_ids": []},
        {"id": 1, "tokens": len(ids_a), "label": None, "preview_ids": ids_a},
        {"id": 2, "tokens": len(ids_b) + 40, "label": None, "preview_ids": ids_b},
    ]}


def test_previews_are_the_tokenizers_text_and_decoded_once(smol_dir: Path) -> None:
    tok = load_tokenizer(smol_dir)
    previews = PreviewTexts(tok)
    first = previews.fill(_tree(tok))
    texts = [n["text"] for n in first["nodes"]]
    tree = _tree(tok)
    assert texts[0] == "root"
    assert texts[1] == tok.decode(tree["nodes"][1]["preview_ids"])
    # the node holds more tokens than its preview: the text says so
    assert texts[2] == tok.decode(tree["nodes"][2]["preview_ids"]) + "…"
    assert all("preview_ids" not in n for n in first["nodes"])
    misses = previews.cache_info().misses
    second = previews.fill(tree)
    assert [n["text"] for n in second["nodes"]] == texts
    assert previews.cache_info().misses == misses == 2
