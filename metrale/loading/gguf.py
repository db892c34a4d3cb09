"""Load a llama-architecture GGUF file: config from its metadata, weights under the model's names.

`mx.load(path, return_metadata=True)` reads the tensors and the metadata. Q4_0 / Q4_1 / Q8_0
tensors come back as MLX affine-quantized triples (`name.weight` packed uint32, `name.scales`,
`name.biases`, float16, group size 32); MLX casts every other quantization (K-quants, ...) to
float16 arrays. SmolLM2's file is Q4_1 with a Q8_0 token embedding.

RoPE layout. llama.cpp's converter permutes the rows of attn_q / attn_k inside each head so that
interleaved (GPT-J, `traditional=True`) RoPE applies: row 2j + h of a GGUF head holds row
h * head_dim / 2 + j of the Hugging Face head (h in {0, 1}). `unpermute_rope_rows` undoes it
(rows of the packed weight, scales and biases move together: quantization groups run along the
input axis), so the model always sees the Hugging Face layout with `rope_traditional=False`.

Quantized weights stay quantized by default (metrale.loading.weights.keep_quantized_default): on a
GPU for MLX's quantized kernels, on CPU for metrale's (kernels/qmm.py); `dtype=` on CPU dequantizes.
K-quants (Q4_K, Q6_K, ...) and the other types MLX does not map arrive as float16 tensors; when
weights are kept they are re-quantized at load to 8-bit affine, group 32 (`requantize_widened`,
logged): 8 bits hold a 4-6 bit K-quant's values within a fraction of its own step, so the model's
accuracy stays the checkpoint's while the CPU kernels read 1.1 bytes per weight instead of 4.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kernels.runtime import mx, nn
import numpy as np

from metrale.loading.default_model import ModelNotFoundError, default_model_path
from metrale.loading.weights import LoadedModel, build_model, dequantize_affine, keep_quantized_default
from metrale.models import ModelConfig, RopeScaling
from metrale.text.tokenizer import Tokenizer

__all__ = [
    "GGUF_ARCHITECTURES", "LoadedModel", "build_model", "config_from_gguf_metadata", "dequantize_affine",
    "gguf_to_hf_weights", "load_gguf", "permute_rope_rows", "requantize_widened", "unpermute_rope_rows",
]

logger = logging.getLogger(__name__)

# general.architecture values this loader maps (llama.cpp writes Mistral 7B and TinyLlama as "llama")
GGUF_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias|scales|biases)$")

# general.file_type (llama.cpp's llama_ftype): the float ones, and names for the log
FLOAT_FILE_TYPES = {0: "F32", 1: "F16", 32: "BF16"}
FILE_TYPE_NAMES = {
    2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L",
    14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
    30: "IQ4_XS", 31: "IQ1_M", 36: "TQ1_0", 37: "TQ2_0",
}
REQUANT_BITS, REQUANT_GROUP = 8, 32


def _scalar(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if isinstance(value, mx.array) and value.dtype == mx.float32:
        # the shortest decimal that is this float32 (1e-05, not 9.999999747378752e-06)
        return float(str(np.float32(value.item())))
    return value.item() if isinstance(value, mx.array) else value


def config_from_gguf_metadata(metadata: Mapping[str, Any], tensor_names: set[str] | frozenset[str]) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.*` keys) and the file's tensor names (ties, biases).

    ValueError for an unsupported architecture (listing the supported ones) or missing keys.
    """
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def need(key: str) -> Any:
        value = _scalar(metadata, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(_scalar(metadata, f"{arch}.attention.key_length", hidden // heads))
    rope_dims = int(_scalar(metadata, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    scaling = None
    scaling_type = _scalar(metadata, f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", factor=float(need("rope.scaling.factor")))
    elif scaling_type not in ("none", None):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported; supported: none, linear")
    vocab = _scalar(metadata, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(metadata.get("tokenizer.ggml.tokens", ()))
    window = _scalar(metadata, f"{arch}.attention.sliding_window")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_scalar(metadata, f"{arch}.attention.head_count_kv", heads)),
        intermediate_size=int(need("feed_forward_length")),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_scalar(metadata, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(_scalar(metadata, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=None if window in (None, 0) else int(window),
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


def gguf_to_hf_weights(weights: Mapping[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """GGUF tensor names -> the model's parameter names, with Q/K rows back in Hugging Face order.

    Quantized triples keep their three parts (`.weight`, `.scales`, `.biases`). `rope_freqs.weight`
    is metadata, not a parameter, and is dropped (see `load_gguf`). ValueError on unknown names."""
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        if name == "rope_freqs.weight":
            continue
        match = _TENSOR_NAME.match(name)
        layer, base, part = match.groups() if match else (None, None, None)
        table = _GLOBAL_NAMES if layer is None else _LAYER_NAMES
        if base not in table:
            raise ValueError(f"unexpected GGUF tensor {name!r} for a {config.architecture} model")
        target = table[base] if layer is None else f"model.layers.{layer}.{table[base]}"
        if base == "attn_q":
            array = unpermute_rope_rows(array, config.num_attention_heads)
        elif base == "attn_k":
            array = unpermute_rope_rows(array, config.num_key_value_heads)
        out[f"{target}.{part}"] = array
    return out


def requantize_widened(weights: dict[str, mx.array], metadata: Mapping[str, Any]) -> int:
    """In a quantized GGUF (general.file_type not F32/F16/BF16), re-quantize in place every 2-D
    float16/bfloat16 `.weight` (what mx.load makes of K-quants and other types MLX does not map) to
    REQUANT_BITS-bit affine triples with group REQUANT_GROUP (float16 scales and biases, as GGUF's own).
    Returns how many tensors were re-quantized; logs the count and the file type."""
    file_type = _scalar(metadata, "general.file_type")
    if file_type is None or int(file_type) in FLOAT_FILE_TYPES:
        return 0
    count = 0
    for name in [n for n in weights if n.endswith(".weight")]:
        w = weights[name]
        if w.ndim != 2 or w.dtype not in (mx.float16, mx.bfloat16) or w.shape[1] % REQUANT_GROUP:
            continue
        module = name.removesuffix(".weight")
        packed, scales, biases = mx.quantize(w.astype(mx.float32), group_size=REQUANT_GROUP, bits=REQUANT_BITS)
        weights[name] = packed  # (out, in * bits / 32) uint32
        weights[f"{module}.scales"] = scales.astype(mx.float16)  # (out, in / group)
        weights[f"{module}.biases"] = biases.astype(mx.float16)
        mx.eval(weights[name], weights[f"{module}.scales"], weights[f"{module}.biases"])
        count += 1
    if count:
        kind = FILE_TYPE_NAMES.get(int(file_type), f"type {int(file_type)}")
        logger.info("GGUF file type %s: re-quantized %d float16 tensors (types mx.load widens) to %d-bit affine, "
                    "group %d", kind, count, REQUANT_BITS, REQUANT_GROUP)
    return count


def load_gguf(
    path: str | Path | None = None, *, keep_quantized: bool | None = None, dtype: mx.Dtype | None = None,
    shard: Callable[[nn.Module], None] | None = None,
) -> LoadedModel:
    """Load a GGUF model file (None: the default model) with its tokenizer.

    keep_quantized: None = metrale.loading.weights.keep_quantized_default (kept on a GPU, and on CPU
    with dtype None and the CPU kernels built); kept, float16 tensors of a quantized file are
    re-quantized (`requantize_widened`).
    dtype: activations and float weights; None = float32 on CPU, float16 on a GPU.
    """
    start = time.perf_counter()
    path = default_model_path() if path is None else Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"no GGUF file at {path}")
    on_cpu = mx.default_device() == mx.cpu
    keep = keep_quantized_default(keep_quantized, dtype)
    dtype = dtype or (mx.float32 if on_cpu else mx.float16)

    raw, metadata = mx.load(str(path), return_metadata=True)
    config = config_from_gguf_metadata(metadata, frozenset(raw))
    if "rope_freqs.weight" in raw:  # Llama 3.1 scaling, stored as per-frequency divisors
        factors = tuple(float(f) for f in raw["rope_freqs.weight"].astype(mx.float32).tolist())
        config = dataclasses.replace(config, rope_freq_factors=factors)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    weights = gguf_to_hf_weights(raw, config)
    del raw
    if keep:
        requantize_widened(weights, metadata)
    model, quantized = build_model(config, weights, keep_quantized=keep, dtype=dtype, shard=shard)
    return LoadedModel(
        model=model, config=config, tokenizer=tokenizer, path=path, dtype=dtype,
        quantization=quantized, load_seconds=time.perf_counter() - start,
    )
