"""Checkpoint layouts: Hugging Face's per-expert tensors (Qwen3-MoE's mlp.experts.E.*, Mixtral's
block_sparse_moe.experts.E.w1/w2/w3) and Phi-3's fused projections load to the same model as mlx-lm's
stacked / split names."""

from __future__ import annotations

import json

import pytest

from tests.metrale.arch_helpers import arch_folder, random_prompts, write_folder
from tests.metrale.model_helpers import PagedHarness

import mlx.core as mx  # noqa: E402  (the helpers load the fast BLAS first)
from mlx.utils import tree_flatten  # noqa: E402

from metrale.loading import load_model  # noqa: E402
from metrale.loading.layouts import stack_experts  # noqa: E402

MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def per_expert(params: dict[str, mx.array], mixtral: bool) -> dict[str, mx.array]:
    """mlx-lm's stacked switch_mlp tensors -> one tensor per expert, as Hugging Face checkpoints hold them."""
    out = {}
    for name, value in params.items():
        if ".switch_mlp." not in name:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.") if mixtral else name] = value
            continue
        layer, rest = name.split(".mlp.switch_mlp.")
        proj, part = rest.split(".")
        for e in range(value.shape[0]):
            if mixtral:
                out[f"{layer}.block_sparse_moe.experts.{e}.{MIXTRAL_NAMES[proj]}.{part}"] = value[e]
            else:
                out[f"{layer}.mlp.experts.{e}.{proj}.{part}"] = value[e]
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_per_expert_checkpoints_equal_stacked_ones(tmp_path, arch):
    stacked = arch_folder(tmp_path / "stacked", arch)
    params = dict(mx.load(str(stacked / "model.safetensors")))
    if arch == "mixtral":  # mlx-lm's mixtral names its block block_sparse_moe too
        params = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in params.items()}
    config = json.loads((stacked / "config.json").read_text())
    split = write_folder(tmp_path / "split", config, per_expert(params, arch == "mixtral"))
    prompts = random_prompts(config["vocab_size"], [7, 1, 12])
    chunks = [(f"s{i}", p) for i, p in enumerate(prompts)]
    want = load_model(str(stacked), dtype=mx.float32)
    got = load_model(str(split), dtype=mx.float32)
    got_logits = PagedHarness(got.config).step(got.model, chunks)
    for g, w in zip(got_logits, PagedHarness(want.config).step(want.model, chunks)):
        assert mx.array_equal(g, w).item()


def test_missing_expert_is_named():
    weights = {f"model.layers.0.mlp.experts.{e}.up_proj.weight": mx.zeros((2, 2)) for e in (0, 1, 3)}
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.\*.up_proj.weight: experts \[0, 1, 3\]"):
        stack_experts(weights, 4)


def test_phi3_fused_projections_are_split(tmp_path):
    folder = arch_folder(tmp_path, "phi3")  # mlx-lm's phi3 writes qkv_proj and gate_up_proj
    names = set(mx.load(str(folder / "model.safetensors")))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    loaded = load_model(str(folder), dtype=mx.float32)
    params = dict(tree_flatten(loaded.model.parameters()))
    assert params["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert params["model.layers.0.mlp.gate_proj.weight"].shape == (96, 64)
