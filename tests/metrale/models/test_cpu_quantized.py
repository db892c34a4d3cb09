"""The default model on the quantized CPU kernels against the same model dequantized to float32
(--dtype float32): greedy continuations, logits, and every instruction set (real model)."""

from __future__ import annotations

import pytest

from tests.metrale.model_helpers import PagedHarness

import mlx.core as mx  # noqa: E402  (model_helpers loads the fast BLAS first)

from kernels import ext  # noqa: E402
from kernels.qmm import QuantizedEmbeddingCPU, QuantizedLinearCPU  # noqa: E402
from metrale.loading.default_model import ModelNotFoundError  # noqa: E402
from metrale.loading.gguf import load_gguf  # noqa: E402
from metrale.models.cpu_quantized import set_activation_bits  # noqa: E402

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not ext.has_qmm_kernels(), reason="kernels not built: python -m kernels.build")]

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
    "Once upon a time, there was a",
    "The three primary colors are",
    "<|im_start|>user\nList three fruits.<|im_end|>\n<|im_start|>assistant\n",
]
STEPS = 12
# per activation precision: max |quantized - float32| over the vocab as a fraction of the float32
# logits' range, and how many of the PROMPTS must continue identically for STEPS tokens
# (0: auto: the prompts' step in int8, being 16+ rows, then decode steps of 6 rows in int16)
LOGIT_TOL = {16: 2e-3, 12: 1e-2, 8: 0.05, 0: 0.05}
MIN_SAME = {16: len(PROMPTS) - 1, 12: len(PROMPTS) - 1, 8: len(PROMPTS) // 3, 0: len(PROMPTS) // 2}
LONG_TEXT = ("The history of the city begins with a small settlement on the river, where traders from the north "
             "exchanged furs and salt for grain. Over the centuries the town grew into a market, then a port, and "
             "finally the capital of a province. ") * 12


@pytest.fixture(scope="module")
def models():
    try:
        return load_gguf(), load_gguf(dtype=mx.float32)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def float32_greedy(models):
    return greedy(models[1], PROMPTS)


def greedy(loaded, prompts, steps=STEPS):
    """All prompts in one varlen batch per step over the paged cache: ([first-step logits (vocab,)
    per prompt], [greedy continuation per prompt])."""
    harness = PagedHarness(loaded.config, num_blocks=64, block_size=16)
    return harness.greedy(loaded.model, [loaded.tokenizer.encode(p) for p in prompts], steps)


def test_default_model_keeps_its_quantization(models):
    quantized, dequantized = models
    assert quantized.describe_quantization() == "quantized weights: 4-bit group 32 x 210, 8-bit group 32 x 1"
    layer = quantized.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinearCPU)
    assert isinstance(quantized.model.model.embed_tokens, QuantizedEmbeddingCPU)  # also the tied lm_head
    assert dequantized.quantization == {} and dequantized.describe_quantization() == "float32 weights"


@pytest.mark.parametrize("activation_bits", [16, 12, 8, 0])
def test_greedy_and_logits_match_float32(models, float32_greedy, activation_bits):
    """int16 activations: the float32 model's tokens; int12: the same tokens, logits within 2.1e-3 of their
    range; int8 (llama.cpp's Q8) and auto: close. Measured (avx512 and avx512_amx alike): 6, 6, 4 and 4 of 6
    identical for 12 tokens; the auto ones diverge at tokens 8 and 11 (the int8-rounded prompt's K/V moves
    a near-tie later on)."""
    quantized, _ = models
    set_activation_bits(quantized.model, activation_bits)
    try:
        q_firsts, q_outs = greedy(quantized, PROMPTS)
    finally:
        set_activation_bits(quantized.model, 16)
    f_firsts, f_outs = float32_greedy
    for prompt, q_first, f_first in zip(PROMPTS, q_firsts, f_firsts):
        spread = (mx.max(f_first) - mx.min(f_first)).item()
        assert mx.abs(q_first - f_first).max().item() < LOGIT_TOL[activation_bits] * spread, prompt
    same = sum(q == f for q, f in zip(q_outs, f_outs))
    assert same >= MIN_SAME[activation_bits], f"{same} of {len(PROMPTS)} continuations identical"


def test_a_400_token_prompt_in_int8_stays_close_to_float32(models):
    """The prompt-chunk case auto runs in int8: the last position's logits after 400 tokens, as a fraction of
    the float32 logits' range (measured: int16 max 5.6e-5 mean 1.8e-5 (8.3e-5, 4.2e-5 on AMX), int12 max
    9.4e-4 mean 1.9e-4, int8 max 1.5e-2 mean 6.4e-3 (1.1e-2, 1.8e-3 on AMX)), the
    same argmax, and 12 greedy tokens after 100-, 200- and 400-token prompts (measured: all identical)."""
    quantized, dequantized = models
    ids = quantized.tokenizer.encode(LONG_TEXT)[:400]
    assert len(ids) == 400

    def last_logits(loaded):
        (logits,) = PagedHarness(loaded.config, num_blocks=64, block_size=16).step(loaded.model, [("s", ids)])
        return logits[-1]  # (vocab,)

    want = last_logits(dequantized)
    spread = (mx.max(want) - mx.min(want)).item()
    bounds = {16: (2e-4, 1e-4), 12: (4e-3, 1e-3), 8: (0.03, 0.012), 0: (0.03, 0.012)}  # (max, mean) x spread
    prompts = [quantized.tokenizer.decode(ids[:n]) for n in (100, 200, 400)]
    _, f_outs = greedy(dequantized, prompts)
    try:
        for bits, (max_tol, mean_tol) in bounds.items():
            set_activation_bits(quantized.model, bits)
            diff = mx.abs(last_logits(quantized) - want)
            assert diff.max().item() < max_tol * spread and diff.mean().item() < mean_tol * spread, bits
            assert mx.argmax(last_logits(quantized)).item() == mx.argmax(want).item(), bits
        _, q_outs = greedy(quantized, prompts)  # auto
        assert sum(q == f for q, f in zip(q_outs, f_outs)) >= 2
    finally:
        set_activation_bits(quantized.model, 16)


def test_int12_continues_64_tokens_as_int16_does(models):
    """int12 activations (16x finer than int8) against int16 over 64 greedy tokens on the first 5 PROMPTS.
    Measured (avx512_amx, with the tiled paged decode attention): 3 of 5 identical for all 64 tokens, "def
    fibonacci(n):" from token 53 on and "Once upon a time" from token 25 (4 of 5 with the attention before
    it); int16 equals the float32 model on all 5, int8 diverges from it on 4 (tokens 1, 8, 24, 25); the
    French capital is Paris either way."""
    quantized, _ = models
    outs = {}
    try:
        for bits in (16, 12):
            set_activation_bits(quantized.model, bits)
            _, outs[bits] = greedy(quantized, PROMPTS[:5], steps=64)
    finally:
        set_activation_bits(quantized.model, 16)
    assert sum(a == b for a, b in zip(outs[12], outs[16])) >= 3
    assert "Paris" in quantized.tokenizer.decode(outs[12][0][:12])


@pytest.mark.parametrize("isa", [i for i in ext.supported_isas() if i != ext.cpu_isa()] or ["none"])
def test_every_instruction_set_gives_the_same_logits(models, isa):
    """The fallback (scalar) and AVX2 kernels run the same integer arithmetic as the best set: with
    int16 activations the logits agree to float32 accumulation order (with int8 a rounding that
    flips in one layer moves the logits by int8 noise, ~1% of their range)."""
    if isa == "none":
        pytest.skip("this CPU runs one kernel set")
    quantized, _ = models
    ids = quantized.tokenizer.encode(PROMPTS[0])
    set_activation_bits(quantized.model, 16)  # (under auto this prompt's 16+ rows would run int8)
    try:
        (want,) = PagedHarness(quantized.config).step(quantized.model, [("s", ids)])
        ext.set_cpu_isa(isa)
        (got,) = PagedHarness(quantized.config).step(quantized.model, [("s", ids)])
    finally:
        ext.set_cpu_isa("auto")
        set_activation_bits(quantized.model, 16)
    assert mx.abs(got - want).max().item() < 1e-3 * (mx.max(want) - mx.min(want)).item()
