"""``runtime.models.tokenizer.encode``: the ids transformers' own call gives, whichever way they are computed.

Every API's intake, the chat renderer and the router tokenise through it; where the backend is set as transformers
sets it for a call, it asks the Rust backend directly (no offsets, no ``BatchEncoding``). The oracle is
``tokenizer(text, add_special_tokens=...).input_ids`` on the same tokenizer, for texts that exercise the
pre-tokenizer, the byte fallback and the special tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from runtime.models.folders import load_tokenizer
from runtime.models.tokenizer import asks_backend, encode, tokenize

TEXTS = [
    "",
    " ",
    "Hello, world!",
    "Question: Ines had 45 euros and spent 24 on a birthday present. How many euros are left?\nAnswer:",
    "  leading and trailing spaces   \n\n\ttabs\r\nCRLF",
    "Hé, 2+2=? 🙂 日本語のテキスト — ünïcödé, emoji 👩‍👩‍👧 and \u200b zero width",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> in the middle <|im_end|> of text",
    "def f(x):\n    return x ** 2  # code\n",
    "a" * 3000,
]


def texts() -> list[str]:
    rng = random.Random(7)
    pieces = ["the", " ", "\n", "12", "3.5", "<|im_start|>", "é", "🙂", "\t", "Q:", "A:", "—", "x" * 7, "  "]
    return TEXTS + ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 60))) for _ in range(40)]


@pytest.fixture(params=["default", "tiny"])
def folder(request: pytest.FixtureRequest, smol_dir: Path, tiny_model_dir: Path) -> Path:
    return smol_dir if request.param == "default" else tiny_model_dir


@pytest.mark.parametrize("special", [True, False])
def test_encode_gives_the_ids_of_transformers_own_call(folder: Path, special: bool) -> None:
    tok = load_tokenizer(folder)
    assert asks_backend(tok)  # the models' tokenizers take the direct way from the first call
    for text in texts():
        assert encode(tok, text, add_special_tokens=special) == list(
            tok(text, add_special_tokens=special).input_ids), text[:80]
    assert tokenize(tok, TEXTS[3]) == list(tok(TEXTS[3]).input_ids)


def test_a_backend_set_otherwise_is_not_asked_directly(smol_dir: Path) -> None:
    """Truncation or padding set on the backend, or special tokens split: transformers' call decides (it resets
    the first two for a plain call), so the ids are still its own."""
    tok = load_tokenizer(smol_dir)
    text = TEXTS[6] * 20
    want = list(tok(text).input_ids)
    tok.backend_tokenizer.enable_truncation(max_length=5)
    assert not asks_backend(tok)
    assert encode(tok, text, add_special_tokens=True) == want
    assert tok.backend_tokenizer.truncation is None  # transformers' call turned it off for later calls
    tok.backend_tokenizer.enable_padding(length=4096)
    assert not asks_backend(tok)
    assert encode(tok, text, add_special_tokens=True) == want
    split = load_tokenizer(smol_dir)
    split.split_special_tokens = True
    assert not asks_backend(split)
    assert encode(split, text, add_special_tokens=True) == list(split(text).input_ids) != want
