"""Tiny GGUF files of every architecture, written with the `gguf` package the way llama.cpp's
converter writes them (convert_hf_to_gguf.py, conversion/*.py): GGUF tensor names, llama-family q/k
rows permuted for interleaved RoPE, gemma's norms stored as 1 + w, phi3's q/k/v and gate/up fused,
experts stacked as ffn_*_exps, the `{arch}.*` metadata keys llama.cpp reads."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np

from tests.metrale.model_helpers import CHATML_TEMPLATE, CONTROL_TOKENS, tiny_vocab

from metrale.loading.gguf import permute_rope_rows  # noqa: E402
from metrale.models import ModelConfig  # noqa: E402

# metrale architecture -> general.architecture as llama.cpp writes it
GGUF_ARCH = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "ministral3": "mistral3",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps", "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}
_GEMMA_LAYER = {
    **_LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
QUANT_TYPES = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q8_0": gguf.GGMLQuantizationType.Q8_0}


def gguf_tensors(config: ModelConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model's float parameters (Hugging Face layout) -> GGUF tensors as llama.cpp's converter stores them."""
    arch = GGUF_ARCH[config.architecture]
    gemma = arch in ("gemma2", "gemma3")
    table = _GEMMA_LAYER if gemma else _LAYER
    out: dict[str, np.ndarray] = {}
    for name, value in params.items():
        module, part = name.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, layer, rest = module.split(".", 3)
            target = f"blk.{layer}.{table[rest]}"
        else:
            target = _GLOBAL[module]
        if arch in ("llama", "mistral3") and target.endswith(("attn_q", "attn_k")):
            heads = config.num_attention_heads if target.endswith("attn_q") else config.num_key_value_heads
            value = np.array(permute_rope_rows(value, heads))
        if gemma and target.endswith("norm") and part == "weight":
            value = value + 1.0
        out[f"{target}.{part}"] = np.asarray(value, dtype=np.float32)
    if arch == "phi3":
        for layer in range(config.num_hidden_layers):
            b = f"blk.{layer}"
            out[f"{b}.attn_qkv.weight"] = np.concatenate([out.pop(f"{b}.attn_{n}.weight") for n in "qkv"])
            out[f"{b}.ffn_up.weight"] = np.concatenate([out.pop(f"{b}.ffn_gate.weight"), out[f"{b}.ffn_up.weight"]])
    return out


def _write_metadata(writer: gguf.GGUFWriter, config: ModelConfig, arch: str) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    if config.num_experts:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
        if config.layer_types is not None:
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    if config.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling.factor)
    elif scaling is not None and scaling.rope_type == "yarn":  # what conversion/mistral3.py writes
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling.factor)
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_position_embeddings)
        writer.add_rope_scaling_yarn_beta_fast(scaling.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(scaling.beta_slow)
        writer.add_rope_scaling_yarn_log_mul(scaling.mscale_all_dim)
    elif scaling is not None:
        raise ValueError(f"no GGUF form for rope scaling {scaling.rope_type!r} in this helper")
    if config.attn_temperature_scale is not None:
        writer.add_attn_temperature_scale(config.attn_temperature_scale)


def _write_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    tokens, merges = tiny_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in CONTROL_TOKENS else 1 for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML_TEMPLATE)


def _quantizable(name: str, value: np.ndarray) -> bool:
    # llama.cpp keeps 1-D tensors and the MoE router (ffn_gate_inp) in float
    return value.ndim >= 2 and value.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name


def write_arch_gguf(path: Path, config: ModelConfig, params: Mapping[str, np.ndarray], *,
                    quant: str | None = None) -> Path:
    """A GGUF of `config` (metrale's ModelConfig, its architecture a GGUF_ARCH key) holding `params`
    (the model's float parameters). quant: "Q4_0" / "Q8_0" for every matrix llama.cpp quantizes."""
    arch = GGUF_ARCH[config.architecture]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, arch)
    if quant is not None:
        writer.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quant])
    _write_tokenizer(writer, config.vocab_size)
    for name, value in gguf_tensors(config, params).items():
        if quant is not None and _quantizable(name, value):
            kind = QUANT_TYPES[quant]
            writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
