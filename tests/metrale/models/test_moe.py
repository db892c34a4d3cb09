"""Mixture of experts: routing against a dense reference (every expert computed for every token,
weighted by the router's renormalized top-k probabilities), and a quantized MoE GGUF on the CPU
kernels (kernels/moe.py) against the same file dequantized to float32."""

from __future__ import annotations

import numpy as np
import pytest

from tests.metrale.arch_helpers import ARCH_CONFIGS, arch_folder, random_prompts
from tests.metrale.gguf_helpers import write_arch_gguf
from tests.metrale.model_helpers import PagedHarness

import mlx.core as mx  # noqa: E402  (the helpers load the fast BLAS first)
from mlx.utils import tree_flatten  # noqa: E402

from kernels.moe import QuantizedSwitchGLUCPU, has_moe_kernels  # noqa: E402
from metrale.loading import load_model  # noqa: E402
from metrale.loading.gguf import load_gguf  # noqa: E402
from metrale.models import ModelConfig  # noqa: E402
from metrale.models.moe import QuantizedSwitchLinear, SparseMoeBlock, route  # noqa: E402

needs_moe_kernels = pytest.mark.skipif(not has_moe_kernels(), reason="kernels not built: python -m kernels.build")


def dense_reference(block: SparseMoeBlock, x: np.ndarray, top_k: int, normalize: bool) -> np.ndarray:
    """Every expert on every token (float64), weighted by the router: the top-k probabilities
    (renormalized when `normalize`), zero for the other experts. x (T, D) -> (T, D)."""
    params = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(block.parameters())}
    logits = x @ params["gate.weight"].T  # (T, E)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[:, :top_k]  # (T, top_k)
    weights = np.zeros_like(probs)
    np.put_along_axis(weights, chosen, np.take_along_axis(probs, chosen, -1), -1)
    if normalize:
        weights /= weights.sum(-1, keepdims=True)
    gate, up, down = (params[f"switch_mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
    out = np.zeros_like(x)
    for e in range(gate.shape[0]):
        g, u = x @ gate[e].T, x @ up[e].T  # (T, I)
        y = (g / (1 + np.exp(-g)) * u) @ down[e].T  # (T, D): expert e on every token
        out += weights[:, e : e + 1] * y
    return out


@pytest.mark.parametrize("tokens", [3, 40])  # 40 tokens x top-2 = 80 rows: the path that sorts rows by expert
@pytest.mark.parametrize("normalize", [True, False])
def test_routing_equals_every_expert_weighted_by_the_router(tokens, normalize):
    config = ModelConfig.from_hf_dict({**ARCH_CONFIGS["qwen3_moe"], "norm_topk_prob": normalize})
    mx.random.seed(tokens)
    block = SparseMoeBlock(config)
    x = np.random.default_rng(tokens).standard_normal((tokens, config.hidden_size))
    got = np.array(block(mx.array(x.astype(np.float32))))
    want = dense_reference(block, x, config.num_experts_per_tok, normalize)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_route_picks_the_top_k_and_renormalizes():
    logits = mx.array([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.0]])
    indices, weights = route(logits, 2, normalize=True)
    assert [sorted(r) for r in indices.tolist()] == [[1, 2], [0, 3]]
    assert mx.allclose(weights.sum(-1), mx.ones(2)).item()
    _, raw = route(logits, 2, normalize=False)
    probs = mx.softmax(logits, axis=-1)
    assert mx.allclose(raw.sum(-1), mx.array([probs[0, 1] + probs[0, 2], probs[1, 0] + probs[1, 3]])).item()


@pytest.fixture(scope="module")
def moe_ggufs(tmp_path_factory):
    """{quant: path} of one random qwen3_moe model written float, Q8_0 and Q4_0."""
    root = tmp_path_factory.mktemp("moe")
    folder = arch_folder(root, "qwen3_moe", hidden_size=128, moe_intermediate_size=64, head_dim=32)
    loaded = load_model(str(folder), dtype=mx.float32)
    params = {k: np.array(v) for k, v in tree_flatten(loaded.model.parameters())}
    return {q: write_arch_gguf(root / f"moe-{q}.gguf", loaded.config, params, quant=None if q == "F32" else q)
            for q in ("F32", "Q8_0", "Q4_0")}


@needs_moe_kernels
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_quantized_moe_gguf_runs_its_experts_on_the_cpu_kernels(moe_ggufs, quant):
    """Kept quantized (the CPU default), the experts are QuantizedSwitchGLUCPU modules, and the logits
    stay within 2e-3 of their range of the same file dequantized to float32 (mx.gather_mm), with the
    same greedy tokens."""
    kept = load_gguf(moe_ggufs[quant])
    dequantized = load_gguf(moe_ggufs[quant], dtype=mx.float32)
    layers = kept.model.model.layers
    assert all(isinstance(layer.mlp.switch_mlp, QuantizedSwitchGLUCPU) for layer in layers)
    assert {(q["bits"], q["group_size"]) for q in kept.quantization.values()} == {(8 if quant == "Q8_0" else 4, 32)}
    prompts = random_prompts(kept.config.vocab_size, [21, 1, 12, 30])
    got = PagedHarness(kept.config).step(kept.model, [(f"s{i}", p) for i, p in enumerate(prompts)])
    want = PagedHarness(dequantized.config).step(dequantized.model, [(f"s{i}", p) for i, p in enumerate(prompts)])
    for g, w in zip(got, want):
        span = (w.max() - w.min()).item()
        assert mx.abs(g - w).max().item() < 2e-3 * span
        assert mx.argmax(g[-1]).item() == mx.argmax(w[-1]).item()


def test_float_gguf_and_quantized_files_route_the_same_tokens(moe_ggufs):
    """The Q8_0 file's router stays float (llama.cpp keeps ffn_gate_inp unquantized): its top-k
    choices on the first layer equal the float file's for the same inputs."""
    f32 = load_gguf(moe_ggufs["F32"], dtype=mx.float32).model.model.layers[0].mlp
    q8 = load_gguf(moe_ggufs["Q8_0"], dtype=mx.float32).model.model.layers[0].mlp
    assert mx.array_equal(f32.gate.weight, q8.gate.weight).item()
    x = mx.random.normal((16, 128))
    a, _ = route(f32.gate(x), 2, True)
    b, _ = route(q8.gate(x), 2, True)
    assert mx.array_equal(mx.sort(a, axis=-1), mx.sort(b, axis=-1)).item()


@needs_moe_kernels
def test_plain_mlx_quantized_experts_match_the_kernels(moe_ggufs, monkeypatch):
    """The path other backends take (experts kept quantized, mx.gather_qmm; forced here on CPU with
    METRALE_MATMUL=reference) against the CPU kernels on the same Q8_0 file."""
    kernels = load_gguf(moe_ggufs["Q8_0"])
    monkeypatch.setenv("METRALE_MATMUL", "reference")
    plain = load_gguf(moe_ggufs["Q8_0"], keep_quantized=True)
    assert isinstance(plain.model.model.layers[0].mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    prompts = random_prompts(kernels.config.vocab_size, [9, 1, 17])
    chunks = [(f"s{i}", p) for i, p in enumerate(prompts)]
    got = PagedHarness(plain.config).step(plain.model, chunks)
    want = PagedHarness(kernels.config).step(kernels.model, chunks)
    for g, w in zip(got, want):
        assert mx.abs(g - w).max().item() < 2e-3 * (w.max() - w.min()).item()
