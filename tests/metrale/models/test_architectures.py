"""Every architecture (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, ministral3, qwen3_moe,
mixtral) loaded from a Hugging Face folder equals mlx-lm's implementation on the same weights:
logits over the paged cache, and greedy generation through the batched engine against mlx-lm's own
stream_generate."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.metrale.arch_helpers import (
    ARCH_CONFIGS, GEMMA3_WINDOW, arch_folder, load_reference, random_prompts, reference_generate,
)
from tests.metrale.model_helpers import PagedHarness

import mlx.core as mx  # noqa: E402  (the helpers load the fast BLAS first)

from metrale import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from metrale.loading import load_model  # noqa: E402
from metrale.models import ModelConfig, get_model_class, supported_architectures  # noqa: E402

ATOL, RTOL = 1e-4, 1e-4
VARIANTS = {
    **{arch: (arch, {}) for arch in ARCH_CONFIGS},
    "llama with sliding layers": (
        "llama", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": GEMMA3_WINDOW},
    ),
}
LENGTHS = [21, 1, 12, 30]  # two prompts longer than the gemma3 window of 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {name: arch_folder(root / name.replace(" ", "-"), arch, **extra) for name, (arch, extra) in VARIANTS.items()}


def _close(got: mx.array, want: mx.array) -> bool:
    return got.shape == want.shape and mx.allclose(got, want, atol=ATOL, rtol=RTOL).item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_flat_forward_then_decode_matches_mlx_lm(folders, variant):
    """Four sequences in one flat forward, then two chunked-prefill/decode steps, every row's
    logits against mlx-lm's logits of the whole sequence."""
    loaded = load_model(str(folders[variant]))
    reference, _ = load_reference(folders[variant])
    prompts = random_prompts(loaded.config.vocab_size, LENGTHS)
    more = random_prompts(loaded.config.vocab_size, [1, 5, 1, 1], seed=2)
    harness = PagedHarness(loaded.config)
    first = harness.step(loaded.model, [(f"s{i}", p) for i, p in enumerate(prompts)])
    second = harness.step(loaded.model, [(f"s{i}", m) for i, m in enumerate(more)])
    for i, (p, m) in enumerate(zip(prompts, more)):
        want = reference(mx.array([p + m]))[0]  # (L, vocab)
        assert _close(first[i], want[: len(p)]), (variant, i, mx.abs(first[i] - want[: len(p)]).max().item())
        assert _close(second[i], want[len(p):]), (variant, i, mx.abs(second[i] - want[len(p):]).max().item())


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_engine_greedy_generation_equals_mlx_lm_generate(folders, variant):
    """16 greedy tokens for four concurrent prompts (chunked prefill: 24 tokens a step) through
    AsyncEngine, against mlx-lm's stream_generate of each prompt alone."""
    folder = folders[variant]
    reference, ref_tokenizer = load_reference(folder)
    prompts = random_prompts(ARCH_CONFIGS[VARIANTS[variant][0]]["vocab_size"], [21, 12, 30, 9], seed=3)
    want = [reference_generate(reference, ref_tokenizer, p, 16) for p in prompts]
    # a float32 cache: random tiny weights have near-tied logits, and this compares with float32 mlx-lm exactly
    config = EngineConfig(model=str(folder), kv_cache_bytes=4 << 20, block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=24, kv_cache_dtype="float32")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        engine.check_integrity()
    assert [r.token_ids for r in results] == want


def test_gemma3_sliding_window_and_local_rope_matter(folders):
    """The windowed layers and their own RoPE base change the logits past the window (so the
    equalities above are not vacuous); a wider window leaves the first `window` positions alone."""
    loaded = load_model(str(folders["gemma3"]))
    tokens = random_prompts(loaded.config.vocab_size, [20])[0]
    (base,) = PagedHarness(loaded.config).step(loaded.model, [("s", tokens)])  # (20, vocab)
    wide = dataclasses.replace(loaded.config, sliding_window=1000)  # local layers attend to everything
    same_rope = dataclasses.replace(loaded.config, rope_local_theta=loaded.config.rope_theta)
    changed = {}
    for name, config in (("wide", wide), ("same_rope", same_rope)):
        other = get_model_class("gemma3")(config)
        other.update(loaded.model.parameters())
        (changed[name],) = PagedHarness(config).step(other, [("s", tokens)])  # (20, vocab)
        assert mx.abs(changed[name][GEMMA3_WINDOW:] - base[GEMMA3_WINDOW:]).max().item() > 1e-2, name
    assert _close(changed["wide"][:GEMMA3_WINDOW], base[:GEMMA3_WINDOW])


def test_gemma3_final_logit_softcapping(folders):
    loaded = load_model(str(folders["gemma3"]))
    capped_config = dataclasses.replace(loaded.config, final_logit_softcapping=5.0)
    capped = get_model_class("gemma3_text")(capped_config)
    capped.update(loaded.model.parameters())
    hidden = mx.random.normal((3, loaded.config.hidden_size))  # (N, D)
    plain = loaded.model.compute_logits(hidden)  # (N, vocab)
    assert _close(capped.compute_logits(hidden), 5.0 * mx.tanh(plain / 5.0))


def test_registry_lists_every_family():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "phi3", "ministral3", "qwen3_moe",
            "mixtral"} <= set(supported_architectures())


# -- config.json parsing of the new families ----------------------------------------------------------


def test_gemma3_config_defaults_and_pattern():
    """A sparse gemma3 text_config (as the 4B checkpoint ships) takes Hugging Face's defaults."""
    config = ModelConfig.from_hf_dict({
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 12,
        "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    })
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 256)
    assert (config.vocab_size, config.rms_norm_eps, config.hidden_act) == (262208, 1e-6, "gelu_pytorch_tanh")
    assert (config.rope_theta, config.rope_local_theta, config.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert config.tie_word_embeddings and config.rope_scaling.factor == 8.0
    windows = [config.layer_sliding_window(i) for i in range(12)]
    assert windows == [1024] * 5 + [None] + [1024] * 5 + [None]
    assert config.attention_scale == 256**-0.5


def test_rope_parameters_per_layer_type():
    """transformers 5 writes gemma3's RoPE as one entry per layer type."""
    config = ModelConfig.from_hf_dict({
        **ARCH_CONFIGS["gemma3"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
        },
    })
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling.factor) == (500000.0, 20000.0, 4.0)
    with pytest.raises(ValueError, match="scaled RoPE on sliding layers"):
        ModelConfig.from_hf_dict({**ARCH_CONFIGS["gemma3"], "rope_parameters": {
            "full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_type": "linear", "factor": 2.0},
        }})


def test_qwen_sliding_window_flags():
    off = ModelConfig.from_hf_dict(ARCH_CONFIGS["qwen2"])  # sliding_window 32768 written, but switched off
    assert off.sliding_window is None and off.layer_sliding_window(1) is None
    on = ModelConfig.from_hf_dict({**ARCH_CONFIGS["qwen2"], "use_sliding_window": True, "max_window_layers": 1})
    assert [on.layer_sliding_window(i) for i in range(2)] == [None, 32768]
    mistral = ModelConfig.from_hf_dict({**ARCH_CONFIGS["mistral"], "sliding_window": 16})
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [16, 16]  # every layer, as before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for 4 layers"),
        ({"layer_types": ["full_attention", "chunked_attention"] * 2}, r"layer_types \['chunked_attention'\]"),
        ({"sliding_window": None}, "sliding_attention layers but sliding_window is not set"),
        ({"hidden_activation": "relu"}, "hidden activation 'relu' is not supported"),
        ({"query_pre_attn_scalar": -1}, "query_pre_attn_scalar must be None or > 0"),
        ({"final_logit_softcapping": 0.0}, "final_logit_softcapping must be None or > 0"),
        ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be None or > 0"),
    ],
)
def test_new_config_fields_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**ARCH_CONFIGS["gemma3"], **overrides})
