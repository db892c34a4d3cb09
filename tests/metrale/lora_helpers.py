"""Test helpers for LoRA: random adapters written as mlx-lm and PEFT folders, and the merged-weights reference."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from metrale.models.config import ModelConfig  # noqa: E402
from metrale.models.lora_spec import TARGET_KEYS, lora_targets  # noqa: E402

Weights = dict[tuple[int, str], tuple[mx.array, mx.array]]  # (layer, key) -> (A (in, r), B (r, out)), unscaled


def random_adapter(config: ModelConfig, rank: int, keys: Sequence[str] = TARGET_KEYS,
                   layers: Sequence[int] | None = None, seed: int = 0) -> Weights:
    """Random A and B (B non-zero, unlike a fresh PEFT adapter) for `keys` of `layers` (all by default)."""
    targets = lora_targets(config)
    mx.random.seed(seed)
    weights = {}
    for layer in range(config.num_hidden_layers) if layers is None else layers:
        for key in keys:
            fan_in, fan_out = targets[key]
            a = mx.random.normal((fan_in, rank)) / fan_in ** 0.5
            b = mx.random.normal((rank, fan_out)) / rank ** 0.5
            weights[(layer, key)] = (a, b)
    return weights


def write_mlx_adapter(folder: Path, weights: Weights, rank: int, scale: float) -> Path:
    """mlx-lm's layout: adapters.safetensors with lora_a (in, r) / lora_b (r, out), scale absolute."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted({key for _, key in weights})
    config = {"fine_tune_type": "lora", "num_layers": len({layer for layer, _ in weights}),
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys}}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for (layer, key), (a, b) in weights.items():
        tensors[f"model.layers.{layer}.{key}.lora_a"] = a
        tensors[f"model.layers.{layer}.{key}.lora_b"] = b
    mx.save_safetensors(str(folder / "adapters.safetensors"), tensors)
    return folder


def write_peft_adapter(folder: Path, weights: Weights, rank: int, alpha: float, *, rslora: bool = False,
                       dtype: mx.Dtype = mx.float32) -> Path:
    """PEFT's layout: adapter_model.safetensors with lora_A.weight (r, in) / lora_B.weight (out, r)."""
    folder.mkdir(parents=True, exist_ok=True)
    modules = sorted({key.split(".")[-1] for _, key in weights})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules, "bias": "none",
              "use_rslora": rslora, "modules_to_save": None, "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for (layer, key), (a, b) in weights.items():
        prefix = f"base_model.model.model.layers.{layer}.{key}"
        tensors[f"{prefix}.lora_A.weight"] = a.T.astype(dtype)
        tensors[f"{prefix}.lora_B.weight"] = b.T.astype(dtype)
    mx.save_safetensors(str(folder / "adapter_model.safetensors"), tensors)
    return folder


def merge_into(model: nn.Module, weights: Weights, scale: float) -> None:
    """The reference: W += scale * (A @ B)^T in a float model's own nn.Linear weights (mlx-lm's fuse)."""
    layers = model.model.layers
    for (layer, key), (a, b) in weights.items():
        part, name = key.split(".")
        linear = getattr(getattr(layers[layer], part), name)
        linear.weight = linear.weight + scale * (a @ b).T
    mx.eval(model.parameters())
