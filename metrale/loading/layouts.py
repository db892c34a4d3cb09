"""Checkpoint layouts -> the model's: stacked experts, split fused projections.

Experts. Hugging Face writes one tensor per expert; mlx-lm (and metrale) hold them stacked:

    model.layers.L.mlp.experts.E.gate_proj.weight           (I, D) each  (Qwen3-MoE)
    model.layers.L.block_sparse_moe.experts.E.w1.weight      (I, D) each  (Mixtral: w1 gate, w3 up, w2 down)
      -> model.layers.L.mlp.switch_mlp.gate_proj.weight      (E, I, D)

Mixtral's `block_sparse_moe.` becomes `mlp.` everywhere (mlx-lm's stacked `switch_mlp` names too),
so one model class serves both families.

Fused projections. Phi-3 stores q/k/v as one `self_attn.qkv_proj` (GGUF: `attn_qkv`) and gate/up as
one `mlp.gate_up_proj` (GGUF: `ffn_up` of 2 * intermediate rows), gate first; `split_fused` cuts
them into the llama names (the rows of packed weights, scales and biases alike).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kernels.runtime import mx
import numpy as np

from metrale.models import ModelConfig

__all__ = ["rename_mixtral", "split_fused", "stack_experts"]

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(\w+)\.(weight|scales|biases)$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def rename_mixtral(name: str) -> str:
    """Mixtral's block_sparse_moe names -> the model's mlp names (`w1` -> `gate_proj`, ...)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for old, new in _MIXTRAL_PROJ.items():
        name = name.replace(f".{old}.", f".{new}.")
    return name


def stack_experts(weights: Mapping[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """Stack every layer's per-expert tensors into (E, ...) `mlp.switch_mlp.*` tensors; other names
    pass through. ValueError when a layer lacks an expert or has one out of range."""
    out: dict[str, mx.array] = {}
    groups: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    for name, array in weights.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = array
            continue
        layer, expert, proj, part = match.groups()
        groups.setdefault((layer, proj, part), {})[int(expert)] = array
    for (layer, proj, part), experts in groups.items():
        if sorted(experts) != list(range(num_experts)):
            raise ValueError(
                f"{layer}.mlp.experts.*.{proj}.{part}: experts {sorted(experts)[:8]}... do not cover "
                f"0..{num_experts - 1}"
            )
        out[f"{layer}.mlp.switch_mlp.{proj}.{part}"] = mx.stack([experts[e] for e in range(num_experts)])
    return out


def _split_rows(array: mx.array, sizes: list[int]) -> list[mx.array]:
    """array (sum(sizes), ...) -> one (size, ...) per entry."""
    if array.shape[0] != sum(sizes):
        raise ValueError(f"a fused tensor of {array.shape[0]} rows cannot hold parts of {sizes} rows")
    return mx.split(array, np.cumsum(sizes)[:-1].tolist(), axis=0)


def split_fused(module: str, array: mx.array, config: ModelConfig) -> dict[str, mx.array] | None:
    """A fused module's tensor -> {part module: rows}; None when `module` is not a fused one.

    module: `...self_attn.qkv_proj` (or `...attn_qkv`), `...mlp.gate_up_proj`, or `...mlp.up_proj`
    holding 2 * intermediate_size rows (GGUF phi3)."""
    for fused in (".self_attn.qkv_proj", ".attn_qkv"):
        if module.endswith(fused):
            layer = module.removesuffix(fused)
            q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
            parts = _split_rows(array, [q, kv, kv])
            return {f"{layer}.self_attn.{n}_proj": p for n, p in zip("qkv", parts)}
    gate_up = module.endswith(".mlp.gate_up_proj")
    if gate_up or (module.endswith(".mlp.up_proj") and array.shape[0] == 2 * config.intermediate_size):
        layer = module.removesuffix(".gate_up_proj" if gate_up else ".up_proj")
        gate, up = _split_rows(array, [config.intermediate_size] * 2)
        return {f"{layer}.gate_proj": gate, f"{layer}.up_proj": up}
    return None
