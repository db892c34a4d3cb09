"""Model architectures, by the name a checkpoint gives (GGUF `general.architecture`, config.json
`model_type`).

Model classes are imported on first use, so `import metrale.models` (and its config module) does
not pull in mlx. Every class follows the runner's contract of `metrale.models.llama.LlamaForCausalLM`:
`model(token_ids (T,), positions (T,), kv_cache, attn_metadata) -> hidden (T, D)` and
`model.compute_logits(hidden (N, D)) -> (N, vocab)`, built as `cls(ModelConfig)`.
"""

from __future__ import annotations

import importlib

from metrale.models.config import ModelConfig, RopeScaling

# architecture name -> "module:class". Mistral is the llama architecture (with a sliding window
# in v0.1); "gemma3" is the multimodal checkpoints' type, loaded as their text model. Phi-3 is llama
# once its fused qkv / gate_up are split at load; Ministral 3 is llama with yarn RoPE and a query
# temperature (ModelConfig.attn_temperature_scale).
MODEL_ARCHITECTURES: dict[str, str] = {
    "llama": "metrale.models.llama:LlamaForCausalLM",
    "mistral": "metrale.models.llama:LlamaForCausalLM",
    "qwen2": "metrale.models.qwen2:Qwen2ForCausalLM",
    "qwen3": "metrale.models.qwen3:Qwen3ForCausalLM",
    "gemma3": "metrale.models.gemma3:Gemma3ForCausalLM",
    "gemma3_text": "metrale.models.gemma3:Gemma3ForCausalLM",
    "gemma2": "metrale.models.gemma2:Gemma2ForCausalLM",
    "phi3": "metrale.models.llama:LlamaForCausalLM",
    "ministral3": "metrale.models.llama:LlamaForCausalLM",
    "qwen3_moe": "metrale.models.moe:Qwen3MoeForCausalLM",
    "mixtral": "metrale.models.moe:MixtralForCausalLM",
}

__all__ = ["MODEL_ARCHITECTURES", "ModelConfig", "RopeScaling", "get_model_class", "supported_architectures"]


def supported_architectures() -> tuple[str, ...]:
    """The architecture names metrale can build, sorted."""
    return tuple(sorted(MODEL_ARCHITECTURES))


def get_model_class(architecture: str) -> type:
    """The model class for `architecture`; ValueError listing the supported ones otherwise."""
    target = MODEL_ARCHITECTURES.get(architecture)
    if target is None:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
