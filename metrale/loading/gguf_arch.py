"""GGUF architectures: what llama.cpp's converter (convert_hf_to_gguf.py, conversion/*.py) writes for
each family, and how metrale reads it back into the Hugging Face layout its models use.

    general.architecture   model class        what the converter changed, undone here
    llama                  llama / mixtral    q/k rows permuted for interleaved RoPE; experts stacked
                                              (ffn_*_exps, Mixtral) with llama.expert_count, or one
                                              tensor each (ffn_gate.E, early Mixtral files)
    mistral3               ministral3         as llama; yarn RoPE, attention temperature (llama 4 beta)
    qwen2                  qwen2              nothing (q/k/v biases)
    qwen3                  qwen3              nothing (attn_q_norm / attn_k_norm)
    qwen3moe               qwen3_moe          nothing; experts ffn_*_exps (E, I, D), router ffn_gate_inp
    gemma2                 gemma2             every *norm.weight stored + 1; windows on even layers
    gemma3                 gemma3_text        every *norm.weight stored + 1; windows but every 6th layer
    phi3                   phi3 (llama)       q/k/v fused into attn_qkv, gate/up into ffn_up (gate first)

Tensors: `blk.N.<name>.{weight,bias}` (quantized: `.weight` packed, `.scales`, `.biases`, as
`mx.load` returns them). Norm names differ per family: llama's ffn_norm is the pre-MLP norm
(post_attention_layernorm); gemma's ffn_norm is pre_feedforward_layernorm and post_attention_norm /
post_ffw_norm are the sandwich norms.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from kernels.runtime import mx
import numpy as np

from metrale.loading.layouts import split_fused, stack_experts
from metrale.models import ModelConfig, RopeScaling

__all__ = [
    "GGUF_ARCHITECTURES", "config_from_gguf_metadata", "gguf_to_hf_weights", "metadata_scalar", "permute_rope_rows",
    "unpermute_rope_rows",
]

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias|scales|biases)$")
# early Mixtral GGUFs: one tensor per expert (llama.cpp's LLM_TENSOR_FFN_*_EXP, still read)
_EXPERT_NAME = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.(weight|scales|biases)$")
# tensors that are metadata, not parameters: Llama 3.1's rope divisors (read by load_gguf)
_DROPPED = ("rope_freqs.weight",)


@dataclasses.dataclass(frozen=True)
class GGUFFamily:
    """How llama.cpp stores one architecture. model_type: metrale's class (MODEL_ARCHITECTURES);
    permuted_qk: q/k rows permuted for interleaved RoPE (llama.cpp's LlamaModel converter);
    norm_shift: added to every norm weight by the converter (gemma's 1 + w)."""

    model_type: str
    permuted_qk: bool = False
    norm_shift: float = 0.0
    layer_names: Mapping[str, str] = dataclasses.field(default_factory=lambda: _LAYER_NAMES)


FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", permuted_qk=True),
    "mistral3": GGUFFamily("ministral3", permuted_qk=True),
    "qwen2": GGUFFamily("qwen2"),
    "qwen3": GGUFFamily("qwen3"),
    "qwen3moe": GGUFFamily("qwen3_moe"),
    "gemma2": GGUFFamily("gemma2", norm_shift=1.0, layer_names=_GEMMA_LAYER_NAMES),
    "gemma3": GGUFFamily("gemma3_text", norm_shift=1.0, layer_names=_GEMMA_LAYER_NAMES),
    "phi3": GGUFFamily("phi3"),
}
GGUF_ARCHITECTURES = tuple(sorted(FAMILIES))


def metadata_scalar(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A GGUF metadata value as a Python scalar (arrays of one element unwrapped, float32 as the
    shortest decimal that is that float: 1e-05, not 9.999999747378752e-06)."""
    value = metadata.get(key, default)
    if isinstance(value, mx.array) and value.size == 1 and value.dtype == mx.float32:
        return float(str(np.float32(value.item())))
    return value.item() if isinstance(value, mx.array) and value.size == 1 else value


def _family(metadata: Mapping[str, Any]) -> tuple[str, GGUFFamily]:
    arch = metadata.get("general.architecture")
    if arch not in FAMILIES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    return arch, FAMILIES[arch]


def _rope_scaling(arch: str, get: Any) -> RopeScaling | None:
    kind = get("rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    factor = float(get("rope.scaling.factor", 1.0))
    if kind == "linear":
        return None if factor == 1.0 else RopeScaling("linear", factor=factor)
    if kind == "yarn":
        original = get("rope.scaling.original_context_length")
        if original is None:
            raise ValueError(f"GGUF yarn rope scaling lacks {arch}.rope.scaling.original_context_length")
        return RopeScaling(
            "yarn", factor=factor, original_max_position_embeddings=int(original),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            mscale_all_dim=float(get("rope.scaling.yarn_log_multiplier", 0.0)),
        )
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, yarn "
                     "(llama3 comes as rope_freqs)")


def _layer_types(arch: str, get: Any, layers: int) -> tuple[str, ...] | None:
    """Sliding layers of gemma2 (even ones) and gemma3 (all but every 6th), or as the file says."""
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, mx.array) and pattern.size == layers:  # one bool per layer
        flags = [bool(f) for f in pattern.tolist()]
    elif arch in ("gemma2", "gemma3") or pattern is not None:
        n = int(pattern) if pattern is not None else (2 if arch == "gemma2" else 6)
        flags = [i % n < n - 1 for i in range(layers)]  # llama.cpp's set_swa_pattern
    else:
        return None
    return tuple("sliding_attention" if f else "full_attention" for f in flags)


def _family_fields(arch: str, get: Any, need: Any, hidden: int, heads: int, head_dim: int,
                   layers: int) -> dict[str, Any]:
    """The config fields one family adds (gemma's windows and scale, MoE, Mistral 3's temperature)."""
    fields: dict[str, Any] = {}
    window = get("attention.sliding_window")
    window = None if window in (None, 0) else int(window)
    fields["sliding_window"] = window
    if arch in ("gemma2", "gemma3"):
        fields["hidden_act"] = "gelu_pytorch_tanh"
        # llama.cpp: 27B (46 / 62 layers) scales by hidden / heads, the others by head_dim
        big = layers == (46 if arch == "gemma2" else 62)
        fields["query_pre_attn_scalar"] = float(hidden // heads if big else head_dim)
        fields["final_logit_softcapping"] = get("final_logit_softcapping")
        fields["attn_logit_softcapping"] = get("attn_logit_softcapping") if arch == "gemma2" else None
        if arch == "gemma2" and window is None:
            fields["sliding_window"] = window = 4096  # llama.cpp's default for gemma 2
        if window is not None:
            fields["layer_types"] = _layer_types(arch, get, layers)
        if arch == "gemma3" and window is not None:
            fields["rope_local_theta"] = float(get("rope.freq_base_swa", 10000.0))
    elif window is not None:
        fields["layer_types"] = _layer_types(arch, get, layers)
    experts = int(get("expert_count", 0) or 0)
    if experts:
        fields.update(num_experts=experts, num_experts_per_tok=int(need("expert_used_count")),
                      moe_intermediate_size=int(get("expert_feed_forward_length") or need("feed_forward_length")),
                      norm_topk_prob=True)  # llama.cpp: qwen3moe and Mixtral renormalize the top-k weights
    beta = get("attention.temperature_scale")
    if beta:
        original = get("attention.temperature_length") or get("rope.scaling.original_context_length")
        if original is None:
            raise ValueError(f"{arch}.attention.temperature_scale needs {arch}.rope.scaling.original_context_length")
        fields.update(attn_temperature_scale=float(beta), attn_temperature_length=int(original))
    return fields


def config_from_gguf_metadata(metadata: Mapping[str, Any], tensor_names: set[str] | frozenset[str]) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.*` keys) and the file's tensor names (ties, biases).

    ValueError for an unsupported architecture (listing the supported ones) or missing keys."""
    arch, family = _family(metadata)

    def get(key: str, default: Any = None) -> Any:
        return metadata_scalar(metadata, f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads, layers = int(need("embedding_length")), int(need("attention.head_count")), int(need("block_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    if "rope_factors_long.weight" in tensor_names or get("rope.scaling.type") == "longrope":
        raise ValueError(f"{arch}: LongRoPE (rope_factors_long / rope_factors_short) is not supported")
    vocab = get("vocab_size")
    if vocab is None:
        vocab = len(metadata.get("tokenizer.ggml.tokens", ()))
    feed_forward = get("feed_forward_length")
    if feed_forward is None or int(feed_forward) == 0:  # some MoE files write 0 for the dense size
        feed_forward = get("expert_feed_forward_length") or need("feed_forward_length")
    model_type = family.model_type
    if arch == "llama" and get("expert_count"):
        model_type = "mixtral"
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        intermediate_size=int(feed_forward),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(arch, get),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
        **_family_fields(arch, get, need, hidden, heads, head_dim, layers),
    )


def permute_rope_rows(w: mx.array, n_heads: int) -> mx.array:
    """Hugging Face -> GGUF row order of a Q or K projection (what llama.cpp's converter does).

    w: (n_heads * head_dim, ...) -> same shape, rows reordered within each head."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: mx.array, n_heads: int) -> mx.array:
    """GGUF -> Hugging Face row order; the inverse of `permute_rope_rows`. w: (n_heads * head_dim, ...)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf_weights(weights: Mapping[str, mx.array], config: ModelConfig,
                       metadata: Mapping[str, Any] | None = None) -> dict[str, mx.array]:
    """GGUF tensor names -> the model's parameter names, in the Hugging Face layout: Q/K rows back
    in order (llama, mistral3), gemma's norms minus the converter's 1, phi3's fused tensors split.

    Quantized triples keep their three parts (`.weight`, `.scales`, `.biases`). metadata: the file's
    (its general.architecture picks the family; None: the llama family). ValueError on unknown names."""
    _, family = _family(metadata if metadata is not None else {"general.architecture": "llama"})
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        if name in _DROPPED:
            continue
        expert = _EXPERT_NAME.match(name)
        if expert is not None:
            layer, proj, index, part = expert.groups()
            out[f"model.layers.{layer}.mlp.experts.{index}.{proj}_proj.{part}"] = array
            continue
        match = _TENSOR_NAME.match(name)
        layer, base, part = match.groups() if match else (None, None, None)
        table = _GLOBAL_NAMES if layer is None else family.layer_names
        if base == "attn_qkv" and layer is not None:
            target = f"model.layers.{layer}.attn_qkv"
        elif base not in table:
            raise ValueError(f"unexpected GGUF tensor {name!r} for a {config.architecture} model")
        else:
            target = table[base] if layer is None else f"model.layers.{layer}.{table[base]}"
        if family.permuted_qk and base == "attn_q":
            array = unpermute_rope_rows(array, config.num_attention_heads)
        elif family.permuted_qk and base == "attn_k":
            array = unpermute_rope_rows(array, config.num_key_value_heads)
        if family.norm_shift and base.endswith("norm") and part == "weight":
            array = array.astype(mx.float32) - family.norm_shift
        pieces = split_fused(target, array, config) or {target: array}
        for piece, value in pieces.items():
            out[f"{piece}.{part}"] = value
    return stack_experts(out, config.num_experts) if config.num_experts else out
