"""From named weights to a model ready for the runner, whatever file they came from.

`build_model` takes weights under the model's own parameter names (`model.layers.0.mlp.up_proj.weight`),
float or MLX affine-quantized triples (`name.weight` packed uint32, `name.scales`, `name.biases`),
checks every name and shape against the model the config describes, and either keeps the
triples quantized or dequantizes them to float at load time (`keep_quantized_default` decides):

    GPU                  kept: nn.QuantizedLinear / nn.QuantizedEmbedding (MLX's quantized kernels)
    CPU, dtype "auto"    kept, computed by the CPU kernels (kernels/qmm.py, swapped in by
                         metrale.models.cpu_quantized); dequantized to float32 when they are not built
    CPU, dtype given     dequantized to that dtype (--dtype float32: float32 BLAS matmuls)

On CPU, formats the kernels do not compute (2, 3, 5, 6 bits) are dequantized even when the rest is kept.

Quantization parameters. A quantized module's group size and bits follow from its shapes and the
in-features of the float module the config describes (packed (out, in * bits / 32), scales
(out, in / group_size)), as mlx-lm infers them; an mlx-lm config's per-module entries, when
given, are used instead and checked against the shapes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kernels import qmm
from kernels.backend import matmul_backend
from kernels.runtime import mx, nn
from mlx.utils import tree_flatten

from metrale.models import ModelConfig, get_model_class
from metrale.models.cpu_quantized import use_cpu_kernels
from metrale.text.tokenizer import Tokenizer

__all__ = ["LoadedModel", "QUANTIZED_BITS", "build_model", "dequantize_affine", "keep_quantized_default"]

logger = logging.getLogger(__name__)

QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs in affine mode
_GROUP_SIZES = (32, 64, 128)
_MAX_LISTED = 5  # names listed in one error message


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner, with what it was built from.

    `path` is the GGUF file or the model folder. `quantization` is {"group_size": g, "bits": b}
    per quantized module path when weights stay quantized, and empty when they were dequantized
    (or stored as floats)."""

    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    dtype: mx.Dtype
    quantization: Mapping[str, Mapping[str, int]]
    load_seconds: float

    def describe_quantization(self) -> str:
        """"float32 weights" or e.g. "quantized weights: 4-bit group 32 x 210, 8-bit group 32 x 1"."""
        if not self.quantization:
            return f"{str(self.dtype).removeprefix('mlx.core.')} weights"
        counts: dict[tuple[int, int], int] = {}
        for q in self.quantization.values():
            key = (q["bits"], q["group_size"])
            counts[key] = counts.get(key, 0) + 1
        parts = [f"{b}-bit group {g} x {n}" for (b, g), n in sorted(counts.items())]
        return "quantized weights: " + ", ".join(parts)


def keep_quantized_default(keep_quantized: bool | None, dtype: mx.Dtype | None) -> bool:
    """Whether quantized weights stay quantized: `keep_quantized` when given; else always on a GPU,
    and on CPU only for dtype None ("auto") with the CPU kernels built (MLX's own CPU
    quantized_matmul is slower than float32 BLAS at every batch size: benchmarks/qmm_bench.py)."""
    if keep_quantized is not None:
        return keep_quantized
    if mx.default_device() != mx.cpu:
        return True
    return dtype is None and matmul_backend() == "kernel"


def dequantize_affine(packed: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """MLX affine-quantized (packed (..., out, in * bits / 32) uint32, scales / biases (..., out, in / group))
    -> float32 (..., out, in), computed in float32 as llama.cpp does (value = q * scale + bias); the
    leading axes are experts (E, out, in).

    `mx.dequantize` with float16 scales rounds through float16 (errors near 1e-3 on the embedding)
    and is ~5x slower on CPU; this unpacks with vectorized shifts instead."""
    scales32, biases32 = scales.astype(mx.float32), biases.astype(mx.float32)  # (out, in / group)
    if 32 % bits:
        return mx.dequantize(packed, scales32, biases32, group_size=group_size, bits=bits)  # (out, in)
    if packed.ndim > 2:  # stacked experts: one (E * out, ...) matrix
        flat = dequantize_affine(packed.reshape(-1, packed.shape[-1]), scales.reshape(-1, scales.shape[-1]),
                                 biases.reshape(-1, biases.shape[-1]), bits, group_size)
        return flat.reshape(*packed.shape[:-1], -1)
    rows = packed.shape[0]
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)  # (32 / bits,): element i sits at bits i*b .. i*b+b-1
    q = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # (out, in * bits / 32, 32 / bits)
    q = q.astype(mx.float32).reshape(rows, -1, group_size)  # (out, in / group, group)
    return (q * scales32[..., None] + biases32[..., None]).reshape(rows, -1)  # (out, in)


def _listed(names: list[str]) -> str:
    more = f" (and {len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def _quantized_modules(
    weights: Mapping[str, mx.array], float_shapes: Mapping[str, tuple[int, ...]],
    overrides: Mapping[str, Any] | None,
) -> dict[str, dict[str, int]]:
    """{module path: {"group_size", "bits"}} for every quantized triple in `weights`.

    float_shapes: the unquantized model's parameter shapes; overrides: mlx-lm's "quantization"
    config (top-level defaults plus per-module entries), or None."""
    found = {}
    for name in weights:
        if not name.endswith(".scales"):
            continue
        module = name.removesuffix(".scales")
        if f"{module}.biases" not in weights:
            raise ValueError(
                f"quantized tensor {module} has scales but no biases (only affine quantization is supported)"
            )
        if f"{module}.weight" not in float_shapes:
            raise ValueError(f"unexpected quantized weight {module}.weight: the model has no such parameter")
        packed, scales = weights[f"{module}.weight"], weights[name]  # (out, in * bits / 32), (out, in / group)
        in_features = float_shapes[f"{module}.weight"][-1]
        inferred = {"group_size": in_features // scales.shape[-1], "bits": packed.shape[-1] * 32 // in_features}
        entry = (overrides or {}).get(module)
        if isinstance(entry, Mapping):
            if entry.get("mode", "affine") != "affine":
                raise ValueError(f"{module}: quantization mode {entry['mode']!r} is not supported; supported: affine")
            stated = {"group_size": int(entry["group_size"]), "bits": int(entry["bits"])}
            if stated != inferred:
                raise ValueError(
                    f"{module}: the config's quantization {stated} does not fit its tensors (packed "
                    f"{tuple(packed.shape)}, scales {tuple(scales.shape)} for {in_features} in-features)"
                )
        if inferred["bits"] not in QUANTIZED_BITS or inferred["group_size"] not in _GROUP_SIZES:
            raise ValueError(
                f"{module}: packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not fit "
                f"{in_features} in-features at any supported bits {QUANTIZED_BITS} and group size {_GROUP_SIZES}"
            )
        found[module] = inferred
    return found


def _dequantize_all(weights: dict[str, mx.array], quantized: Mapping[str, Mapping[str, int]], dtype: mx.Dtype) -> None:
    """Replace every quantized triple in `weights` by its float `dtype` weight, in place."""
    for module, q in quantized.items():
        w = dequantize_affine(
            weights[f"{module}.weight"], weights.pop(f"{module}.scales"), weights.pop(f"{module}.biases"),
            bits=q["bits"], group_size=q["group_size"],
        )  # (out, in) float32
        weights[f"{module}.weight"] = w.astype(dtype)
        mx.eval(weights[f"{module}.weight"])  # one tensor at a time: the packed copy is freed as we go


def _dequantize_unsupported(weights: dict[str, mx.array], quantized: dict[str, dict[str, int]],
                            dtype: mx.Dtype) -> None:
    """On the CPU kernel path: dequantize, in place, the triples whose format the kernels lack."""
    unsupported = {m: q for m, q in quantized.items() if not qmm.supports(q["bits"], q["group_size"])}
    if unsupported:
        logger.info("dequantizing %d layers the CPU kernels do not compute (%s) to %s", len(unsupported),
                    sorted({f"{q['bits']}-bit group {q['group_size']}" for q in unsupported.values()}), dtype)
        _dequantize_all(weights, unsupported, dtype)
        for module in unsupported:
            del quantized[module]


def check_weights(model: nn.Module, weights: Mapping[str, mx.array], config: ModelConfig) -> None:
    """ValueError naming the missing, unexpected or mis-shaped weights of `model` (a config that
    does not describe these weights)."""
    expected = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    summary = (
        f"{config.architecture}: hidden_size {config.hidden_size}, intermediate_size {config.intermediate_size}, "
        f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads / {config.num_key_value_heads} kv "
        f"heads of {config.head_dim}, vocab_size {config.vocab_size}"
    )
    if missing:
        raise ValueError(f"weights missing for the config ({summary}): {_listed(missing)}")
    if unexpected:
        raise ValueError(f"unexpected weights for the config ({summary}): {_listed(unexpected)}")
    for name, shape in expected.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ValueError(
                f"Expected shape {shape} but received shape {got} for parameter {name}: the weights do "
                f"not match the config ({summary})"
            )


def build_model(
    config: ModelConfig, weights: dict[str, mx.array], *, keep_quantized: bool, dtype: mx.Dtype,
    quantization: Mapping[str, Any] | None = None, shard: Callable[[nn.Module], None] | None = None,
) -> tuple[nn.Module, dict[str, dict[str, int]]]:
    """The model of `config` holding `weights` (the model's names; quantized triples allowed).

    `quantization` is an mlx-lm config's "quantization" entry, when there is one. Consumes
    `weights`. Returns (model, {quantized module path: {"group_size", "bits"}}), the mapping empty
    when every triple was dequantized. Kept quantized on CPU with the kernels built (METRALE_MATMUL),
    the layers run on kernels/qmm.py. `shard`, when given, is called on the model once its weights are
    loaded and before the CPU kernels' swap (tensor parallelism: metrale.distributed.sharding keeps
    this rank's share). ValueError on missing, extra or mis-shaped weights."""
    model = get_model_class(config.architecture)(config)
    float_shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}  # no eval: lazy init
    if quantization is not None and quantization.get("mode", "affine") != "affine":
        raise ValueError(f"quantization mode {quantization['mode']!r} is not supported; supported: affine")
    quantized = _quantized_modules(weights, float_shapes, quantization)
    cpu_kernels = keep_quantized and mx.default_device() == mx.cpu and matmul_backend() == "kernel"
    if not keep_quantized:
        _dequantize_all(weights, quantized, dtype)
        quantized = {}
    elif cpu_kernels:
        _dequantize_unsupported(weights, quantized, dtype)
    for name, array in weights.items():
        # scales/biases too: float16 ones make MLX's CPU quantized matmul 35-85x slower than float32 ones
        if mx.issubdtype(array.dtype, mx.floating):
            weights[name] = array.astype(dtype)
    if quantized:
        nn.quantize(model, class_predicate=lambda module_path, _module: quantized.get(module_path, False))
    check_weights(model, weights, config)
    model.load_weights(list(weights.items()), strict=True)
    weights.clear()
    model.eval()
    if shard is not None:
        shard(model)
    if cpu_kernels and quantized:
        use_cpu_kernels(model)  # repacks layer by layer; the MLX-layout copies are freed as it goes
    mx.eval(model.parameters())
    return model, quantized
