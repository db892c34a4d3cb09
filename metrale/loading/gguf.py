"""Load a GGUF file: config from its metadata, weights under the model's names (the architectures
and what llama.cpp's converter changed in each: metrale.loading.gguf_arch).

`read_gguf(path)` (metrale.loading.gguf_file: tensor by tensor; else `mx.load(path, return_metadata=True)`)
reads the tensors and the metadata, as mx.load returns them. Q4_0 / Q4_1 / Q8_0 tensors come back as MLX
affine-quantized triples (`name.weight` packed uint32, `name.scales`, `name.biases`, float16, group size 32);
mx.load casts every other quantization (K-quants, ...) to float16 arrays. SmolLM2's file is Q4_1 with a Q8_0 token embedding.

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
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kernels.runtime import mx, nn

from metrale.loading.default_model import ModelNotFoundError, default_model_path
from metrale.loading.gguf_arch import (
    GGUF_ARCHITECTURES, config_from_gguf_metadata, gguf_to_hf_weights, metadata_scalar, permute_rope_rows,
    unpermute_rope_rows,
)
from metrale.loading.gguf_file import read_gguf
from metrale.loading.weights import LoadedModel, build_model, dequantize_affine, keep_quantized_default
from metrale.text.tokenizer import Tokenizer

__all__ = [
    "GGUF_ARCHITECTURES", "LoadedModel", "build_model", "config_from_gguf_metadata", "dequantize_affine",
    "gguf_to_hf_weights", "load_gguf", "permute_rope_rows", "requantize_widened", "unpermute_rope_rows",
]

logger = logging.getLogger(__name__)

# general.file_type (llama.cpp's llama_ftype): the float ones, and names for the log
FLOAT_FILE_TYPES = {0: "F32", 1: "F16", 32: "BF16"}
FILE_TYPE_NAMES = {
    2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L",
    14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
    30: "IQ4_XS", 31: "IQ1_M", 36: "TQ1_0", 37: "TQ2_0",
}
REQUANT_BITS, REQUANT_GROUP = 8, 32


def requantize_widened(weights: dict[str, mx.array], metadata: Mapping[str, Any]) -> int:
    """In a quantized GGUF (general.file_type not F32/F16/BF16), re-quantize in place every 2-D
    float16/bfloat16 `.weight` (what mx.load makes of K-quants and other types MLX does not map) to
    REQUANT_BITS-bit affine triples with group REQUANT_GROUP (float16 scales and biases, as GGUF's own).
    Returns how many tensors were re-quantized; logs the count and the file type."""
    file_type = metadata_scalar(metadata, "general.file_type")
    if file_type is None or int(file_type) in FLOAT_FILE_TYPES:
        return 0
    count = 0
    for name in [n for n in weights if n.endswith(".weight")]:
        w = weights[name]
        if w.ndim not in (2, 3) or w.dtype not in (mx.float16, mx.bfloat16) or w.shape[-1] % REQUANT_GROUP:
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

    raw, metadata = read_gguf(path)  # tensor by tensor (mx.load maps the whole file beside its copies)
    config = config_from_gguf_metadata(metadata, frozenset(raw))
    if "rope_freqs.weight" in raw:  # Llama 3.1 scaling, stored as per-frequency divisors
        factors = tuple(float(f) for f in raw["rope_freqs.weight"].astype(mx.float32).tolist())
        config = dataclasses.replace(config, rope_freq_factors=factors)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    weights = gguf_to_hf_weights(raw, config, metadata)
    del raw
    if keep:
        requantize_widened(weights, metadata)
    model, quantized = build_model(config, weights, keep_quantized=keep, dtype=dtype, shard=shard)
    return LoadedModel(
        model=model, config=config, tokenizer=tokenizer, path=path, dtype=dtype,
        quantization=quantized, load_seconds=time.perf_counter() - start,
    )
