"""Per-expert checkpoint tensors -> the stacked expert weights of metrale.models.moe.

Hugging Face writes one tensor per expert; mlx-lm (and metrale) hold them stacked:

    model.layers.L.mlp.experts.E.gate_proj.weight           (I, D) each  (Qwen3-MoE)
    model.layers.L.block_sparse_moe.experts.E.w1.weight      (I, D) each  (Mixtral: w1 gate, w3 up, w2 down)
      -> model.layers.L.mlp.switch_mlp.gate_proj.weight      (E, I, D)

Mixtral's `block_sparse_moe.` becomes `mlp.` everywhere (mlx-lm's stacked `switch_mlp` names too),
so one model class serves both families.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kernels.runtime import mx

__all__ = ["rename_mixtral", "stack_experts"]

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
                f"{layer}.mlp.experts.*.{proj}.{part}: experts {sorted(experts)[:8]}... do not cover 0..{num_experts - 1}"
            )
        out[f"{layer}.mlp.switch_mlp.{proj}.{part}"] = mx.stack([experts[e] for e in range(num_experts)])
    return out
