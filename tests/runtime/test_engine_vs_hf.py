"""Greedy output of the Engine equals Hugging Face transformers' generate on the same weights (fp32, CPU),
up to float near-ties (tests/oracle.py: HF's top-2 scores are the reference)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from runtime.engine import Engine
from tests.oracle import WITH_TOP2, Greedy, assert_greedy_agrees

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short story about a lighthouse keeper who",
]


def hf_greedy(model, ids: list[int], new: int) -> Greedy:
    return Greedy.from_hf_generate(model, ids, new, min_new_tokens=new)


def test_smollm2_greedy_equals_transformers(smol_engine, smol_hf):
    tok, hf = smol_hf
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three fruits."}], tokenize=False,
                                   add_generation_prompt=True)
    prompts = [*PROMPTS, chat]
    # all prompts in one batch: batching must not change anyone's tokens
    outs = smol_engine.generate(prompts, {"max_new_tokens": 40, "min_new_tokens": 40, "temperature": 0}, **WITH_TOP2)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt).input_ids
        assert_greedy_agrees(hf_greedy(hf, ids, 40), Greedy.from_native(out), prompt)
        assert out["meta_info"]["completion_tokens"] == 40


def test_smollm2_stops_where_transformers_stops(smol_engine, smol_hf):
    tok, hf = smol_hf
    ids = tok("The capital of France is").input_ids
    out = smol_engine.generate("The capital of France is", {"max_new_tokens": 48, "temperature": 0}, **WITH_TOP2)
    hf_ref = Greedy.from_hf_generate(hf, ids, 48)
    # where HF stops is only comparable when no near tie comes first: then the tokens are equal throughout
    assert hf_ref.near_tie() is None, f"this prompt has a near tie at step {hf_ref.near_tie()}: pick another"
    assert_greedy_agrees(hf_ref, Greedy.from_native(out), "where transformers stops")
    ref = hf_ref.tokens
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[-1]}
    assert out["text"] == tok.decode(ref[:-1], skip_special_tokens=True)


ARCH_OVERRIDES = {
    "llama": {},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "rope_theta": 1e6},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
}


def make_arch(folder: Path, arch: str, tokenizer_src: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    o = dict(ARCH_OVERRIDES[arch])
    model_type = o.pop("model_type", "llama")
    o.setdefault("architectures", ["LlamaForCausalLM"])
    cfg = AutoConfig.for_model(model_type, vocab_size=49152, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=1024, initializer_range=0.3, tie_word_embeddings=False,
                               eos_token_id=2, bos_token_id=1, **o)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_src / name, folder / name)
    return model


@pytest.mark.parametrize("arch", list(ARCH_OVERRIDES))
def test_tiny_architectures_greedy_equal_transformers(arch, tmp_path, smol_dir):
    hf = make_arch(tmp_path, arch, smol_dir)
    engine = Engine(model=str(tmp_path), max_total_tokens=4096, dtype="float32", log_level="warning")
    try:
        prompts = [[5, 17, 300, 4000, 12], list(range(100, 160)), [7] * 9]
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                                   "ignore_eos": True}, **WITH_TOP2)
        for ids, out in zip(prompts, outs):
            assert_greedy_agrees(hf_greedy(hf, ids, 16), Greedy.from_native(out), arch)
        report = engine.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0, report
    finally:
        engine.shutdown()
