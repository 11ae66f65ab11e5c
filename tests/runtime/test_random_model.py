"""random:NAME models: a config of the named shape and seeded random weights built on the device, no files;
the default model's tokenizer."""

from __future__ import annotations

import pytest
import torch

from runtime.attention import make_attention_backend
from runtime.models.errors import ModelLoadError
from runtime.models.folders import is_random_model, load_tokenizer, resolve_model_path
from runtime.models.loader import attention_shape
from runtime.models.random_model import (
    RANDOM_MODEL_SHAPES,
    build_random_model,
    random_model_config,
    weight_bytes,
)
from tests.oracle import WITH_TOP2, Greedy, assert_greedy_agrees


def test_names_and_configs():
    assert is_random_model("random:tiny") and is_random_model("RANDOM:llama3-8b")
    assert not is_random_model("default") and not is_random_model(None)
    cfg = random_model_config("random:llama3-8b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert cfg.architectures == ["LlamaForCausalLM"]
    # Llama-3-8B has 8.03 B parameters: 16.06 GB in bf16
    assert weight_bytes(cfg, torch.bfloat16) == pytest.approx(16.06e9, rel=0.005)
    assert set(RANDOM_MODEL_SHAPES) == {"llama3-8b", "smollm2-135m", "tiny"}
    with pytest.raises(ModelLoadError, match="unknown random model"):
        random_model_config("random:gpt5")


def test_paths_and_tokenizer_resolve_without_files():
    assert str(resolve_model_path("random:tiny")) == "random:tiny"  # launchers pass the name on unchanged
    tok = load_tokenizer("random:tiny")
    assert tok.decode(tok("hello world").input_ids).strip().endswith("hello world")


def test_weights_are_seeded_and_shaped_and_the_model_runs():
    cfg = random_model_config("random:tiny")
    backend = make_attention_backend("torch_native", attention_shape(cfg))
    a = build_random_model(cfg, backend, torch.float32, "cpu", seed=1)
    b = build_random_model(cfg, backend, torch.float32, "cpu", seed=1)
    c = build_random_model(cfg, backend, torch.float32, "cpu", seed=2)
    assert torch.equal(a.embed_tokens, b.embed_tokens) and not torch.equal(a.embed_tokens, c.embed_tokens)
    layer = a._layer_list[0]
    assert torch.all(layer.input_norm == 1)
    assert 0.015 < float(layer.qkv_weight.std()) < 0.025
    n_params = sum(p.numel() for p in a.parameters())
    assert n_params * 4 == weight_bytes(cfg, torch.float32)


def test_engine_serves_a_random_model(tiny_engine):
    from runtime.engine import Engine

    engine = Engine(model="random:tiny", max_total_tokens=2048, dtype="float32", log_level="warning")
    try:
        params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
        out = engine.generate(input_ids=list(range(5, 25)), sampling_params=params, **WITH_TOP2)
        assert len(out["output_ids"]) == 5
        assert engine.runner.info().path == "random:tiny"
        again = engine.generate(input_ids=list(range(5, 25)), sampling_params=params, **WITH_TOP2)
        assert again["meta_info"]["cached_tokens"] > 0  # the second run reads the prompt's KV from the cache
        assert_greedy_agrees(Greedy.from_native(out), Greedy.from_native(again), "over the cached prompt")
        report = engine.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0
    finally:
        engine.shutdown()
