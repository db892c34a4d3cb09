"""The flat varlen llama over the paged cache equals mlx-lm's llama on the same tiny random weights."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.metrale.model_helpers import PagedHarness, make_twins, reference_logits, tiny_config_dict

import mlx.core as mx  # noqa: E402  (model_helpers loads the fast BLAS first)

from metrale.models import ModelConfig, RopeScaling, get_model_class, supported_architectures  # noqa: E402
from metrale.models.llama import LlamaForCausalLM  # noqa: E402
from metrale.models.rope import FlatRope, llama3_frequencies  # noqa: E402

ATOL = 2e-4
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}
VARIANTS = {
    "smollm-like (GQA, tied)": {},
    "untied MHA with biases": {
        "tie_word_embeddings": False, "num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True,
    },
    "explicit head_dim": {"head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 1},
    "llama3 rope scaling": {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0},
    "linear rope scaling": {"rope_scaling": {"type": "linear", "factor": 4.0}},
    "mistral sliding window": {"model_type": "mistral", "sliding_window": 5},
}


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"seq{i}": [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate(lengths)}


def _expected(reference, config_dict, tokens):
    return reference_logits(reference, tokens, sliding_window=config_dict.get("sliding_window"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_flat_forward_matches_mlx_lm(variant):
    """Four sequences of different lengths (one of length 1) in ONE forward: every row's logits."""
    config_dict = tiny_config_dict(**VARIANTS[variant])
    reference, model = make_twins(config_dict)
    prompts = _prompts(config_dict["vocab_size"], [7, 1, 12, 3])
    harness = PagedHarness(model.config)
    got = harness.step(model, list(prompts.items()))
    for (seq, tokens), logits in zip(prompts.items(), got):
        want = _expected(reference, config_dict, tokens)  # (L, vocab)
        assert logits.shape == want.shape, seq
        assert mx.allclose(logits, want, atol=ATOL, rtol=1e-4).item(), (seq, mx.abs(logits - want).max().item())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_then_decode_matches_mlx_lm(variant):
    """Prefill in two chunks (interleaved with other sequences' chunks), then decode steps, against
    mlx-lm's logits of each full sequence."""
    config_dict = tiny_config_dict(**VARIANTS[variant])
    reference, model = make_twins(config_dict)
    vocab = config_dict["vocab_size"]
    prompts = _prompts(vocab, [9, 6, 13])
    decode_tokens = _prompts(vocab, [3, 3, 3], seed=2)
    full = {seq: prompts[seq] + decode_tokens[seq] for seq in prompts}
    want = {seq: _expected(reference, config_dict, tokens) for seq, tokens in full.items()}
    a, b, c = prompts["seq0"], prompts["seq1"], prompts["seq2"]
    d0, d1, d2 = decode_tokens["seq0"], decode_tokens["seq1"], decode_tokens["seq2"]
    steps = [
        [("seq0", a[:4]), ("seq1", b[:5])],  # first chunks
        [("seq1", b[5:]), ("seq0", a[4:]), ("seq2", c[:8])],  # b's last token alone, a's rest, c's first chunk
        [("seq2", c[8:]), ("seq0", d0[:1]), ("seq1", d1[:1])],  # c's second chunk among decodes
        [("seq0", d0[1:2]), ("seq2", d2[:1]), ("seq1", d1[1:2])],
        [("seq1", d1[2:]), ("seq2", d2[1:2]), ("seq0", d0[2:])],
    ]
    harness = PagedHarness(model.config)
    done = {seq: 0 for seq in prompts}
    for chunks in steps:
        for (seq, tokens), logits in zip(chunks, harness.step(model, chunks)):
            rows = want[seq][done[seq] : done[seq] + len(tokens)]  # (len, vocab)
            assert full[seq][done[seq] : done[seq] + len(tokens)] == list(tokens)
            error = mx.abs(logits - rows).max().item()
            assert mx.allclose(logits, rows, atol=ATOL, rtol=1e-4).item(), (seq, done[seq], error)
            done[seq] += len(tokens)
    assert done == {"seq0": 12, "seq1": 9, "seq2": 15}


def test_compute_logits_on_sample_rows_only():
    """The runner passes only the sample rows to compute_logits: same values as the full rows."""
    config_dict = tiny_config_dict()
    _, model = make_twins(config_dict)
    prompts = _prompts(config_dict["vocab_size"], [5, 1, 4])
    harness = PagedHarness(model.config)
    token_ids, metadata = harness.build(list(prompts.items()))
    hidden = model(token_ids, metadata.positions, harness.cache, metadata)  # (10, D)
    sample_index = mx.array([4, 5, 9], dtype=mx.int32)  # (S',) last row of each sequence
    sampled = model.compute_logits(hidden[sample_index])  # (3, vocab)
    full = model.compute_logits(hidden)  # (10, vocab)
    assert sampled.shape == (3, config_dict["vocab_size"]) and sampled.dtype == mx.float32
    assert mx.allclose(sampled, full[sample_index], atol=1e-5).item()


def test_rope_positions_are_per_token():
    """FlatRope on a flat batch equals rotating each token alone at its own position."""
    config = ModelConfig.from_hf_dict(tiny_config_dict())
    rope = FlatRope(config)
    x = mx.random.normal((6, 3, config.head_dim))  # (T, n_heads, head_dim)
    positions = mx.array([0, 5, 1, 200, 7, 3], dtype=mx.int32)  # (T,)
    got = rope(x, positions)  # (T, n_heads, head_dim)
    for t in range(6):
        one = mx.fast.rope(x[t][:, None, :], config.head_dim, traditional=False, base=config.rope_theta,
                           scale=1.0, offset=int(positions[t]))  # (n_heads, 1, head_dim)
        assert mx.allclose(got[t], one[:, 0, :], atol=1e-5).item(), t


def test_rope_freq_factors_equal_llama3_scaling():
    """GGUF's rope_freqs (per-frequency divisors) reproduce the llama3 schedule exactly."""
    scaling = RopeScaling.from_hf_dict(LLAMA3_SCALING)
    base_config = ModelConfig.from_hf_dict(tiny_config_dict(rope_scaling=LLAMA3_SCALING, rope_theta=500000.0))
    head_dim = base_config.head_dim
    plain = 500000.0 ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)  # (head_dim // 2,)
    factors = tuple((llama3_frequencies(head_dim, 500000.0, scaling) / plain).tolist())
    factor_config = dataclasses.replace(base_config, rope_scaling=None, rope_freq_factors=factors)
    x = mx.random.normal((4, 2, head_dim))  # (T, n_heads, head_dim)
    positions = mx.array([0, 17, 300, 5000], dtype=mx.int32)  # (T,)
    assert mx.allclose(FlatRope(base_config)(x, positions), FlatRope(factor_config)(x, positions), atol=1e-4).item()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"hidden_size": 66}, "not divisible by num_attention_heads"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be > 0"),
        ({"sliding_window": 0}, "sliding_window must be None or > 0"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling type 'longrope' is not supported"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(tiny_config_dict(**overrides))


def test_config_reads_rope_parameters():
    """Newer config.json files put rope_theta and the scaling under rope_parameters."""
    params = {"rope_theta": 500000.0, **LLAMA3_SCALING}
    config = ModelConfig.from_hf_dict({**tiny_config_dict(), "rope_parameters": params})
    assert config.rope_theta == 500000.0 and config.rope_scaling == RopeScaling.from_hf_dict(LLAMA3_SCALING)
    default = {"rope_theta": 1e6, "rope_type": "default"}
    plain = ModelConfig.from_hf_dict({**tiny_config_dict(), "rope_parameters": default})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_config_missing_key_and_freq_factor_length():
    broken = tiny_config_dict()
    del broken["vocab_size"]
    with pytest.raises(ValueError, match="missing required key 'vocab_size'"):
        ModelConfig.from_hf_dict(broken)
    config = ModelConfig.from_hf_dict(tiny_config_dict())
    with pytest.raises(ValueError, match="rope_freq_factors must be 8 positive numbers"):
        dataclasses.replace(config, rope_freq_factors=(1.0, 2.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.vocab_size = 7  # type: ignore[misc]


def test_registry():
    assert {"llama", "mistral"} <= set(supported_architectures())
    assert get_model_class("llama") is LlamaForCausalLM
    with pytest.raises(ValueError, match=r"unsupported model architecture 'gpt_neox'; supported: .*llama"):
        get_model_class("gpt_neox")


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_residual_forward_is_the_layer_by_layer_forward_bit_for_bit(architecture):
    """LlamaModel leaves each layer's residual add to the next norm (one fused node on CPU): the hidden
    states are exactly those of calling every layer and then the final norm."""
    config_dict = tiny_config_dict()
    _, model = make_twins(config_dict)
    if architecture == "gemma3":  # sandwich norms: the layer sums its own residuals
        model = get_model_class("gemma3")(dataclasses.replace(model.config, architecture="gemma3"))
        mx.eval(model.parameters())
    prompts = _prompts(config_dict["vocab_size"], [5, 1, 4])
    harness = PagedHarness(model.config)
    token_ids, metadata = harness.build(list(prompts.items()))
    fused = model(token_ids, metadata.positions, harness.cache, metadata)  # (10, D)
    h = model.model.embed(token_ids)
    for layer in model.model.layers:
        h = layer(h, metadata.positions, harness.cache, metadata)  # each layer sums its own residuals
    assert mx.array_equal(fused, model.model.norm(h)).item()


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_a_wide_step_evaluated_layer_by_layer_is_the_same_and_holds_fewer_activations(architecture, monkeypatch):
    """From EVAL_EACH_LAYER_FROM_TOKENS tokens the forward is evaluated one layer at a time: the same logits bit for
    bit as one lazy evaluation, with fewer activations alive at once (MLX's peak memory)."""
    import metrale.models.llama as llama_module

    config_dict = tiny_config_dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8)
    _, model = make_twins(config_dict)
    if architecture == "gemma3":  # its layers return no separate residual
        model = get_model_class("gemma3")(dataclasses.replace(model.config, architecture="gemma3"))
        mx.eval(model.parameters())
    tokens = [random.Random(3).randrange(config_dict["vocab_size"]) for _ in range(256)]
    results = {}
    monkeypatch.setattr(llama_module, "OVERLAP_LAYERS", False)  # below the threshold: one lazy evaluation
    for threshold in (10**9, 64):
        monkeypatch.setattr(llama_module, "EVAL_EACH_LAYER_FROM_TOKENS", threshold)
        harness = PagedHarness(model.config, num_blocks=80)
        token_ids, metadata = harness.build([("s", tokens)])
        mx.eval(token_ids)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        hidden = model(token_ids, metadata.positions, harness.cache, metadata)
        mx.eval(hidden)
        results[threshold] = (hidden, mx.get_peak_memory() - base)
    (whole, whole_peak), (by_layer, by_layer_peak) = results[10**9], results[64]
    assert mx.array_equal(whole, by_layer).item()
    assert by_layer_peak < whole_peak, (by_layer_peak, whole_peak)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_a_decode_step_handed_to_mlx_layer_by_layer_is_the_same(architecture, monkeypatch):
    """Below EVAL_EACH_LAYER_FROM_TOKENS each layer goes to mx.async_eval as it is built (OVERLAP_LAYERS): the
    same hidden states and K/V pools, bit for bit, as one lazy evaluation of the whole step."""
    import metrale.models.llama as llama_module

    config_dict = tiny_config_dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8)
    _, model = make_twins(config_dict)
    if architecture == "gemma3":  # its layers return no separate residual
        model = get_model_class("gemma3")(dataclasses.replace(model.config, architecture="gemma3"))
        mx.eval(model.parameters())
    rng = random.Random(5)
    sequences = [(f"s{i}", [rng.randrange(config_dict["vocab_size"]) for _ in range(n)]) for i, n in enumerate((9, 4, 1))]
    results = {}
    for overlap in (False, True):
        monkeypatch.setattr(llama_module, "OVERLAP_LAYERS", overlap)
        harness = PagedHarness(model.config, num_blocks=16)
        token_ids, metadata = harness.build(sequences)
        hidden = model(token_ids, metadata.positions, harness.cache, metadata)
        pools = [a for layer in range(model.config.num_hidden_layers) for a in harness.cache.layer(layer)]
        mx.eval(hidden, pools)
        results[overlap] = (hidden, pools)
    (whole, whole_pools), (overlapped, overlapped_pools) = results[False], results[True]
    assert mx.array_equal(whole, overlapped).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(whole_pools, overlapped_pools))
