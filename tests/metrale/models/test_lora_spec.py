"""Adapter folders read and checked against the base model before any weight is loaded (metrale.models.lora_spec)."""

from __future__ import annotations

import json
import math

import pytest

import kernels.runtime  # noqa: F401

import mlx.core as mx  # noqa: E402

from metrale.models.config import ModelConfig  # noqa: E402
from metrale.models.lora_spec import lora_targets, read_adapter  # noqa: E402
from tests.metrale.lora_helpers import random_adapter, write_mlx_adapter, write_peft_adapter  # noqa: E402
from tests.metrale.model_helpers import tiny_config_dict  # noqa: E402

CONFIG = ModelConfig.from_hf_dict(tiny_config_dict())
TARGETS = lora_targets(CONFIG)
LAYERS = CONFIG.num_hidden_layers


def read(folder, max_rank: int = 16):
    return read_adapter(folder, LAYERS, TARGETS, max_rank)


def test_targets_follow_the_model_shapes_and_families():
    assert TARGETS["self_attn.k_proj"] == (64, 2 * 16) and TARGETS["mlp.down_proj"] == (96, 64)
    assert lora_targets(ModelConfig.from_hf_dict(tiny_config_dict(model_type="gemma3_text"))) == {}


def test_mlx_layout_scale_is_absolute_and_peft_scale_is_alpha_over_r(tmp_path):
    weights = random_adapter(CONFIG, 4, keys=("self_attn.q_proj", "mlp.up_proj"))
    spec = read(write_mlx_adapter(tmp_path / "m", weights, rank=4, scale=20.0))
    assert (spec.layout, spec.rank, spec.scale, len(spec.modules)) == ("mlx", 4, 20.0, 2 * LAYERS)
    assert spec.keys == {"self_attn.q_proj", "mlp.up_proj"} and not spec.modules[0].transposed
    peft = read(write_peft_adapter(tmp_path / "p", weights, rank=4, alpha=16.0))
    assert (peft.layout, peft.scale) == ("peft", 4.0) and peft.modules[0].transposed
    rs = read(write_peft_adapter(tmp_path / "r", weights, rank=4, alpha=16.0, rslora=True))
    assert math.isclose(rs.scale, 16.0 / 2.0)


def test_rank_above_the_bound_is_refused(tmp_path):
    folder = write_mlx_adapter(tmp_path / "m", random_adapter(CONFIG, 8), rank=8, scale=1.0)
    with pytest.raises(ValueError, match=r"rank 8 is outside 1..max_lora_rank \(4\)"):
        read(folder, max_rank=4)


def _edit_tensors(folder, file, change):
    tensors = dict(mx.load(str(folder / file)))
    change(tensors)
    mx.save_safetensors(str(folder / file), tensors)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.lora_a": mx.zeros((64, 3))}), "do not match the base"),
    (lambda t: t.update({"model.layers.7.self_attn.q_proj.lora_a": mx.zeros((64, 4)),
                         "model.layers.7.self_attn.q_proj.lora_b": mx.zeros((4, 64))}), "does not have"),
    (lambda t: t.update({"model.embed_tokens.lora_a": mx.zeros((4, 4))}), "not the LoRA A or B"),
    (lambda t: t.pop("model.layers.1.mlp.down_proj.lora_b"), "needs both lora A and lora B"),
])
def test_tensors_that_do_not_fit_the_model_are_refused(tmp_path, change, message):
    folder = write_mlx_adapter(tmp_path / "m", random_adapter(CONFIG, 4), rank=4, scale=1.0)
    _edit_tensors(folder, "adapters.safetensors", change)
    with pytest.raises(ValueError, match=message):
        read(folder)


@pytest.mark.parametrize("config, message", [
    ({"fine_tune_type": "dora", "lora_parameters": {"rank": 4, "scale": 1.0}}, "fine_tune_type"),
    ({"lora_parameters": {"rank": 4}}, "scale must be a finite number"),
    ({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True}, "use_dora"),
    ({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "PREFIX_TUNING"}, "neither"),
    ([1, 2], "JSON object"),
])
def test_configs_that_are_not_plain_lora_are_refused(tmp_path, config, message):
    folder = write_mlx_adapter(tmp_path / "m", random_adapter(CONFIG, 4), rank=4, scale=1.0)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        read(folder)


def test_broken_files_are_refused(tmp_path):
    folder = write_mlx_adapter(tmp_path / "m", random_adapter(CONFIG, 4), rank=4, scale=1.0)
    weights = folder / "adapters.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated: the tensors no longer fit the file
    with pytest.raises(ValueError, match="does not fit"):
        read(folder)
    weights.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header of"):
        read(folder)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read(folder)
    with pytest.raises(ValueError, match="not a folder"):
        read(tmp_path / "absent")
    with pytest.raises(ValueError, match="no LoRA support"):
        read_adapter(folder, LAYERS, {}, 16)
