"""Architecture name (``config.architectures[0]``) → our model class."""

from __future__ import annotations

from typing import Any

from runtime.models.errors import ModelLoadError
from runtime.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 2/3, SmolLM2
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,  # Qwen2 / Qwen2.5
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def architecture_of(config: Any) -> str:
    """The architecture name a config declares (``architectures[0]``)."""
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ModelLoadError(
            "config.json declares no 'architectures'; supported: " + ", ".join(supported_architectures()))
    return str(archs[0])


def get_model_class(config: Any) -> type[LlamaForCausalLM]:
    """Our class for the config's architecture; :class:`ModelLoadError` naming the supported ones if none."""
    arch = architecture_of(config)
    cls = MODEL_REGISTRY.get(arch)
    if cls is None:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(supported_architectures())}")
    return cls
