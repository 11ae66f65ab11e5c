"""The default model end to end: GGUF → cached safetensors folder → our model, greedy equal to transformers.

Uses the real user cache dir, so the suite converts the GGUF once (~25 s) and later runs reuse it.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import PoolDriver

from runtime.models.folders import load_tokenizer, resolve_model_path
from runtime.models.gguf_convert import default_gguf_path
from runtime.models.loader import load_model
from tests.oracle import Greedy, assert_greedy_agrees

pytestmark = pytest.mark.slow

EOS_IDS = (0, 2)  # <|endoftext|>, <|im_end|>
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2_dir():
    return resolve_model_path("default")


def test_conversion_is_cached(smollm2_dir) -> None:
    assert (smollm2_dir / "config.json").is_file() and (smollm2_dir / "model.safetensors").is_file()
    assert resolve_model_path("smollm2") == smollm2_dir  # second call: the cached folder, no conversion
    assert resolve_model_path(str(default_gguf_path())) == smollm2_dir  # the same file given by path


def test_greedy_matches_transformers(smollm2_dir) -> None:
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(smollm2_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [chat, "The capital of France is", "def fibonacci(n):\n    "]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert ids[0][0] == tok.convert_tokens_to_ids("<|im_start|>")

    model, config = load_model(smollm2_dir, dtype=torch.float32)
    assert config.tie_word_embeddings and model.arch.num_layers == 30
    driver = PoolDriver(model, page_size=1, capacity=4096)
    ours: list[list[int]] = [[] for _ in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    work = [(str(i), ids[i]) for i in live]
    for _ in range(NEW_TOKENS):  # all prompts in one batch, stopping each on an eos id like HF does
        outs = driver.run(work)
        work = []
        for i, logits in zip(live, outs):
            token = int(logits[-1].argmax())
            ours[i].append(token)
            rows[i].append(logits[-1])
            if token not in EOS_IDS:
                work.append((str(i), [token]))
        live = [int(rid) for rid, _ in work]
        if not work:
            break

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for i, prompt_ids in enumerate(ids):  # equal up to float near-ties (tests/oracle.py)
        ref = Greedy.from_hf_generate(hf, prompt_ids, NEW_TOKENS, eos_token_id=list(EOS_IDS), pad_token_id=2)
        assert_greedy_agrees(ref, Greedy.from_logits(ours[i], torch.stack(rows[i])),
                             f"prompt {i}: {tok.decode(ours[i])!r} vs {tok.decode(ref.tokens)!r}")
