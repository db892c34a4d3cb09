"""metrale/distributed/sharding.py: each rank's share of a model, and the sharded forward of two real
ranks (ring backend over 127.0.0.1) against the unsharded model."""

from __future__ import annotations

from functools import partial

import pytest

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

from metrale.distributed.sharding import check_tensor_parallel, shard_model  # noqa: E402
from metrale.loading import load_model  # noqa: E402
from metrale.models.config import ModelConfig  # noqa: E402
from tests.distributed.conftest import run_driver  # noqa: E402
from tests.metrale.arch_helpers import ARCH_CONFIGS, arch_folder, reference_model, write_folder  # noqa: E402
from tests.metrale.model_helpers import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.distributed


class FakeGroup:
    """Rank `rank` of `size` for shapes only (its forward would need a real group)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _quantized_folder(tmp_path, intermediate_size: int):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    config_dict = {**ARCH_CONFIGS["llama"], "intermediate_size": intermediate_size}
    model, config_dict = quantize_model(reference_model(config_dict), config_dict, 32, 4)
    return write_folder(tmp_path / f"llama-q4-{intermediate_size}", config_dict, dict(tree_flatten(model.parameters())))


def test_a_size_that_does_not_divide_the_heads_is_refused_with_the_numbers():
    smollm2 = ModelConfig(architecture="LlamaForCausalLM", hidden_size=576, intermediate_size=1536,
                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    numbers = r"size 2 does not divide this model's 9 attention heads and 3 key/value heads"
    with pytest.raises(ValueError, match=numbers):
        check_tensor_parallel(smollm2, 2)
    with pytest.raises(ValueError, match=r"\(sizes that fit: 3\)$"):
        check_tensor_parallel(smollm2, 2)
    check_tensor_parallel(smollm2, 3)
    check_tensor_parallel(smollm2, 1)


def test_each_rank_keeps_its_heads_and_mlp_features(tmp_path):
    path = write_tiny_model(str(tmp_path / "tiny.gguf"))
    full = load_model(path, dtype=None)
    shares = [load_model(path, shard=partial(shard_model, group=FakeGroup(2, rank))) for rank in range(2)]
    attention = [s.model.model.layers[0].self_attn for s in shares]
    assert [(a.n_heads, a.n_kv_heads) for a in attention] == [(2, 1), (2, 1)]
    whole = full.model.model.layers[0]
    q = whole.self_attn.q_proj.weight  # (4 heads * 16, 64)
    assert (attention[1].q_proj.weight == q[32:]).all().item()
    down = whole.mlp.down_proj.weight  # (64, 96)
    assert (shares[0].model.model.layers[0].mlp.down_proj.weight == down[:, :48]).all().item()
    assert shares[0].model.model.embed_tokens.weight.shape == full.model.model.embed_tokens.weight.shape


def test_a_quantized_split_that_cuts_a_group_is_refused(tmp_path):
    folder = _quantized_folder(tmp_path, 96)  # down_proj: 96 inputs = 3 groups of 32
    with pytest.raises(ValueError, match="down_proj has 3 quantization groups of 32 input features"):
        load_model(str(folder), shard=partial(shard_model, group=FakeGroup(2, 0)))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_mixture_of_experts_model_is_refused_naming_its_expert_tensors(arch, tmp_path):
    folder = arch_folder(tmp_path, arch)
    with pytest.raises(ValueError, match=r"tensor parallelism of mixture-of-experts models is not supported: "
                                         r"model\.layers\.0\.mlp is a routed block of \d+ experts "
                                         r"\(mlp\.gate, mlp\.switch_mlp\.gate_proj"):
        load_model(str(folder), shard=partial(shard_model, group=FakeGroup(2, 0)))


def test_a_layer_without_a_tensor_to_split_names_it(tmp_path):
    share = load_model(write_tiny_model(str(tmp_path / "tiny.gguf")), dtype=None)
    del share.model.model.layers[1].mlp["up_proj"]  # a layout this sharding does not know
    with pytest.raises(ValueError, match=r"cannot shard model\.layers\.1\.mlp\.up_proj: the layer has no such "
                                         r"tensor \(its mlp holds down_proj, gate_proj\)"):
        shard_model(share.model, FakeGroup(2, 0))


@pytest.mark.parametrize("arch", ["llama-gguf", "qwen2", "qwen3", "gemma3", "llama-q4-kernels", "llama-q4-float32"])
def test_the_sharded_forward_equals_the_unsharded_one(arch, tmp_path):
    dtype = "auto"
    if arch == "llama-gguf":
        model = write_tiny_model(str(tmp_path / "tiny.gguf"))
    elif arch.startswith("llama-q4"):
        model = str(_quantized_folder(tmp_path, 128))
        dtype = "float32" if arch.endswith("float32") else "auto"
    else:
        model = str(arch_folder(tmp_path, arch))
    # int16 activations: a rank's partial sums differ from the whole row's in float rounding only, and the
    # bound is that; int12's coarser grid turns such a difference at a rounding edge into ~1e-3 of a logit
    result = run_driver("forward", model, dtype, env={"METRALE_QMM_ACTIVATIONS": "int16"})
    if arch == "llama-q4-kernels":
        assert result["quantization"].startswith("quantized weights")
    assert result["kv_heads_per_rank"] == 1
    for error, scale in zip(result["max_abs_error"], result["max_abs_logit"]):
        assert error <= 1e-4 * max(1.0, scale), result
