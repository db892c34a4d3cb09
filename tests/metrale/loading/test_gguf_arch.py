"""Every GGUF architecture (metrale.loading.gguf_arch): a tiny random GGUF written as llama.cpp's converter writes it (the `gguf`
package; tests/metrale/gguf_helpers.py) loads to the same model as the same weights in a Hugging Face
folder, and to mlx-lm's logits where mlx-lm has the family: prefill and decode logits over the paged
cache, and greedy tokens."""

from __future__ import annotations

import pytest

from tests.metrale.arch_helpers import ARCH_CONFIGS, arch_folder, load_reference, random_prompts
from tests.metrale.gguf_helpers import write_arch_gguf
from tests.metrale.model_helpers import PagedHarness

import mlx.core as mx  # noqa: E402  (the helpers load the fast BLAS first)
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from metrale.loading import load_model  # noqa: E402
from metrale.loading.gguf import GGUF_ARCHITECTURES, config_from_gguf_metadata, load_gguf  # noqa: E402

# logits of the GGUF model against the folder's (the same float32 weights, the same code but for the
# layout the loader undid): differences are float32 rounding of reordered rows
ATOL, RTOL = 1e-4, 1e-4
GEMMA_WINDOW = 8
# name: (ARCH_CONFIGS key, config.json overrides, whether mlx-lm's model is a valid reference)
VARIANTS = {
    "llama": ("llama", {}, True),
    "mistral": ("mistral", {}, True),
    "qwen2": ("qwen2", {}, True),
    "qwen3": ("qwen3", {}, True),
    "qwen3_moe": ("qwen3_moe", {}, True),
    "mixtral": ("mixtral", {}, True),
    "phi3": ("phi3", {}, True),
    "mistral3": ("ministral3", {}, True),
    # GGUF has no query_pre_attn_scalar: llama.cpp scales gemma by head_dim (but for the 27B models)
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 16}, True),
    # mlx-lm's gemma2 attends globally on every layer, so windows shorter than the prompts have no reference
    "gemma2 windowed": ("gemma2", {"sliding_window": GEMMA_WINDOW}, False),
    "gemma2": ("gemma2", {}, True),
}
LENGTHS = [21, 1, 12, 30]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """name -> (folder, GGUF path) holding the same random float32 weights."""
    root = tmp_path_factory.mktemp("gguf-archs")
    out = {}
    for name, (arch, overrides, _) in VARIANTS.items():
        folder = arch_folder(root / name.replace(" ", "-"), arch, **overrides)
        loaded = load_model(str(folder), dtype=mx.float32)
        params = {k: np.array(v) for k, v in tree_flatten(loaded.model.parameters())}
        out[name] = folder, write_arch_gguf(root / f"{name.replace(' ', '-')}.gguf", loaded.config, params)
    return out


def _logits(loaded, prompts, more):
    harness = PagedHarness(loaded.config)
    first = harness.step(loaded.model, [(f"s{i}", p) for i, p in enumerate(prompts)])
    second = harness.step(loaded.model, [(f"s{i}", m) for i, m in enumerate(more)])
    return [mx.concatenate([a, b]) for a, b in zip(first, second)]  # per sequence (L, vocab)


def _greedy(loaded, prompt, steps):
    harness = PagedHarness(loaded.config)
    (logits,) = harness.step(loaded.model, [("s", prompt)])
    tokens = [int(mx.argmax(logits[-1]).item())]
    for _ in range(steps - 1):
        (logits,) = harness.step(loaded.model, [("s", tokens[-1:])])
        tokens.append(int(mx.argmax(logits[-1]).item()))
    return tokens


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_equals_folder_and_mlx_lm(pairs, variant):
    """Four sequences in one flat prefill, then a decode/chunk step: the GGUF model's logits equal the
    folder model's (and mlx-lm's), and 8 greedy tokens agree."""
    folder, path = pairs[variant]
    from_gguf = load_gguf(path, dtype=mx.float32)
    from_folder = load_model(str(folder), dtype=mx.float32)
    assert type(from_gguf.model) is type(from_folder.model)  # Mistral's GGUF says llama: the same class
    prompts = random_prompts(from_gguf.config.vocab_size, LENGTHS)
    more = random_prompts(from_gguf.config.vocab_size, [1, 5, 1, 1], seed=2)
    got, want = _logits(from_gguf, prompts, more), _logits(from_folder, prompts, more)
    for i, (g, w) in enumerate(zip(got, want)):
        assert mx.allclose(g, w, atol=ATOL, rtol=RTOL).item(), (variant, i, mx.abs(g - w).max().item())
    if VARIANTS[variant][2]:
        reference, _ = load_reference(folder)
        for i, (p, m) in enumerate(zip(prompts, more)):
            ref = reference(mx.array([p + m]))[0]  # (L, vocab)
            close = mx.allclose(got[i], ref, atol=ATOL, rtol=RTOL).item()
            assert close, (variant, i, mx.abs(got[i] - ref).max().item())
    assert _greedy(from_gguf, prompts[0], 8) == _greedy(from_folder, prompts[0], 8)


def test_gguf_configs_carry_each_family_s_settings(pairs):
    """What the metadata says arrives: windows per layer, soft-caps, experts, yarn, temperature, ties."""
    configs = {name: load_gguf(path, dtype=mx.float32).config for name, (_, path) in pairs.items()}
    gemma2 = configs["gemma2 windowed"]
    assert [gemma2.layer_sliding_window(i) for i in range(4)] == [GEMMA_WINDOW, None, GEMMA_WINDOW, None]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (5.0, 8.0)
    assert configs["gemma3"].rope_local_theta == 10000.0 and configs["gemma3"].rope_scaling.factor == 8.0
    moe = configs["qwen3_moe"]
    assert (moe.architecture, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        "qwen3_moe", 8, 2, 32)
    assert configs["mixtral"].architecture == "mixtral" and configs["mixtral"].num_experts == 4
    mistral3 = configs["mistral3"]
    assert mistral3.rope_scaling.rope_type == "yarn" and mistral3.attn_temperature_scale == pytest.approx(0.1)
    assert configs["llama"].tie_word_embeddings and not configs["qwen3"].tie_word_embeddings
    assert configs["qwen2"].attention_bias is True


def test_unknown_architecture_is_refused_with_the_list():
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'bert'; supported: .*gemma2.*qwen3moe"):
        config_from_gguf_metadata({"general.architecture": "bert"}, frozenset())
    assert {"llama", "mistral3", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3"} <= set(GGUF_ARCHITECTURES)


def test_longrope_and_partial_rope_are_refused():
    metadata = {
        "general.architecture": "phi3", "phi3.embedding_length": mx.array(64), "phi3.block_count": mx.array(2),
        "phi3.attention.head_count": mx.array(4), "phi3.feed_forward_length": mx.array(96),
        "phi3.attention.layer_norm_rms_epsilon": mx.array(1e-5),
    }
    with pytest.raises(ValueError, match="LongRoPE"):
        config_from_gguf_metadata(metadata, frozenset({"rope_factors_long.weight"}))
    with pytest.raises(ValueError, match="partial RoPE"):
        config_from_gguf_metadata({**metadata, "phi3.rope.dimension_count": mx.array(8)}, frozenset())


def test_unexpected_tensor_names_the_architecture(pairs, tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "qwen2")
    for key, value in (("embedding_length", 64), ("block_count", 1), ("feed_forward_length", 96),
                       ("attention.head_count", 4)):
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tensor("blk.0.ssm_conv1d.weight", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    raw, metadata = mx.load(str(tmp_path / "odd.gguf"), return_metadata=True)
    from metrale.loading.gguf import gguf_to_hf_weights

    config = config_from_gguf_metadata({**metadata, "qwen2.vocab_size": mx.array(101)}, frozenset(raw))
    with pytest.raises(ValueError, match="unexpected GGUF tensor 'blk.0.ssm_conv1d.weight' for a qwen2 model"):
        gguf_to_hf_weights(raw, config, metadata)


def test_early_mixtral_files_with_one_tensor_per_expert(pairs, tmp_path):
    """Mixtral GGUFs from before stacked experts name them blk.N.ffn_gate.E: the same model loads."""
    _, path = pairs["mixtral"]
    raw, metadata = mx.load(str(path), return_metadata=True)
    split = {}
    for name, array in raw.items():
        if "_exps." in name:
            base, part = name.rsplit(".", 1)
            for e in range(array.shape[0]):
                split[f"{base.removesuffix('_exps')}.{e}.{part}"] = array[e]
        else:
            split[name] = array
    mx.save_gguf(str(tmp_path / "early.gguf"), split, metadata)
    early, stacked = load_gguf(tmp_path / "early.gguf", dtype=mx.float32), load_gguf(path, dtype=mx.float32)
    for (name, a), (_, b) in zip(tree_flatten(early.model.parameters()), tree_flatten(stacked.model.parameters())):
        assert mx.array_equal(a, b).item(), name


def test_helpers_cover_every_family():
    assert {v[0] for v in VARIANTS.values()} <= set(ARCH_CONFIGS)
