"""The quantized matmul kernels against plain MLX (dequantize + float32 matmul) and against an exact
emulation of their int8 activations, for every format, odd shapes and every instruction set.

Tolerances (docs/quantized-kernels.md):
  vs the emulation (same int8 activations, float64 sums): |y - y_emu| <= 1e-6 * sum_k |x_k w_k|
      (float32 accumulation only)
  vs dequantize + matmul: |y - y_ref| <= sum_k |w_k| d_b(k) / 2 (+ the float32 term), d_b = max|x_b| / 127,
      the rounding of each activation to its grid (d_b = max|x_b| / TOP[activation bits]), for every
      format; and the RMS of the error
      below RMS_TOL[format] of the output's RMS on normal random data
Skipped when the kernels are not built.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kernels import ext as _ext
from kernels import qmm
from tests.kernels.isa_helpers import avx2_disassembly, isa_object

kernel = _ext.load()
needs_kernel = pytest.mark.skipif(kernel is None or not _ext.has_qmm_kernels(),
                                  reason="kernels not built: python -m kernels.build")
ISAS = _ext.supported_isas() if kernel is not None else []
FORMATS = [(bits, gs) for bits in (4, 8) for gs in (32, 64, 128)]
# the largest |X| of each activation precision (kernel_table.h: 127, kMidMax, kWideMax)
TOP = {8: 127, 12: 2032, 16: 32512}
RMS_TOL = ({(bits, gs, 8): 1e-2 for bits, gs in FORMATS} | {(bits, gs, 12): 1e-3 for bits, gs in FORMATS}
           | {(bits, gs, 16): 1e-4 for bits, gs in FORMATS})
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def random_weight(rng, n, k, bits, gs, spread=1.0):
    """(MLX triple, dequantized float32 (n, k) numpy, q (n, k) numpy ints)."""
    w = mx.array((rng.standard_normal((n, k)) * spread).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=gs, bits=bits)
    dequantized = np.array(mx.dequantize(packed, scales, biases, group_size=gs, bits=bits))
    return (packed, scales, biases), dequantized, np.array(qmm.mlx_ints(packed, bits)).astype(np.int64)


def emulate(x, q, scales, biases, gs, activation_bits=16):
    """The kernels' arithmetic in float64: x (T, K) float32 quantized per 32 values exactly as they
    do (xq = rint(float32(x * (top / m))), d = m / top, top = TOP[activation_bits]),
    y = sum_g s sum_b d_b q.xq + b sum_b d_b sum xq."""
    t, k = x.shape
    top = np.float32(TOP[activation_bits])
    xb = x.reshape(t, k // 32, 32)
    m = np.abs(xb).max(-1)  # (T, K / 32) float32
    d = (m / top).astype(np.float64)
    inv = np.where(m > 0, top / np.where(m > 0, m, 1), 0).astype(np.float32)
    xq = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.float64)  # (T, K / 32, 32)
    dots = np.einsum("tbk,nbk->tnb", xq, q.reshape(q.shape[0], k // 32, 32).astype(np.float64))  # (T, N, K / 32)
    sd = np.repeat(np.asarray(scales, np.float64), gs // 32, axis=1)  # (N, K / 32)
    xsum = (xq.sum(-1) * d).reshape(t, k // gs, gs // 32).sum(-1)  # (T, K / gs)
    return (dots * sd[None] * d[:, None, :]).sum(-1) + xsum @ np.asarray(biases, np.float64).T


def quantization_bound(x, w, activation_bits=16):
    """sum_k |w_k| d_b(k) / 2 per (t, n): how far quantized activations may move y, plus float32 slack."""
    t, k = x.shape
    m = np.abs(x.reshape(t, k // 32, 32)).max(-1)  # (T, K / 32)
    half_step = np.repeat(m / (2.0 * TOP[activation_bits]), 32, axis=1)  # (T, K)
    return half_step @ np.abs(w).T + 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6


def run(x, packed_triple, bits, gs, columns, glu=-1, activation_bits=16):
    q, s, b = packed_triple
    return _ext.quantized_matmul(mx.array(x), q, s, b, bits=bits, group_size=gs, columns=columns, glu=glu,
                                 activation_bits=activation_bits)


@needs_kernel
@pytest.mark.parametrize("bits,gs", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 128), (15, 128), (17, 256), (50, 384), (64, 128)])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("activation_bits", [8, 12, 16])
def test_matches_emulation_and_reference(isa, bits, gs, n, k, tokens, activation_bits):
    rng = np.random.default_rng(bits * 1000 + gs + n + k + tokens)
    triple, w, q = random_weight(rng, n, k, bits, gs)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    (out,) = run(x, qmm.pack(*triple, bits, gs), bits, gs, [n], activation_bits=activation_bits)
    out = np.array(out)
    assert out.shape == (tokens, n)
    emu = emulate(x, q, np.array(triple[1]), np.array(triple[2]), gs, activation_bits)
    assert np.all(np.abs(out - emu) <= 1e-6 * (np.abs(x) @ np.abs(w).T) + 1e-6), f"{isa}: off the emulation"
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.all(np.abs(out - ref) <= quantization_bound(x, w, activation_bits)), f"{isa}: outside the bound"


@needs_kernel
@pytest.mark.parametrize("bits,gs", [(4, 32), (8, 128)])
@pytest.mark.parametrize("tokens", [1, 7, 8, 9, 32, 64, 100, 512])
@pytest.mark.parametrize("activation_bits", [8, 12, 16])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16])
def test_token_blocks_match_emulation(isa, bits, gs, tokens, activation_bits, scale_dtype):
    """Prompt-chunk and batched-decode sizes at K = 4096: the activations of 512 tokens span several L2
    token blocks of a task (24 tokens at int16, 48 at int8), with partial tiles at the block and batch
    ends and a partial panel; scales and biases stored as float32 or float16 (the GGUF case)."""
    rng = np.random.default_rng(tokens * 10 + bits + activation_bits)
    n, k = 40, 4096
    triple, w, q = random_weight(rng, n, k, bits, gs)
    triple = (triple[0], *(a.astype(scale_dtype).astype(mx.float32) for a in triple[1:]))
    packed = qmm.pack(*triple, bits, gs)
    assert packed[1].dtype == scale_dtype
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    (out,) = run(x, packed, bits, gs, [n], activation_bits=activation_bits)
    emu = emulate(x, q, np.array(triple[1]), np.array(triple[2]), gs, activation_bits)
    assert np.all(np.abs(np.array(out) - emu) <= 1e-6 * (np.abs(x) @ np.abs(w).T) + 1e-6), f"{isa}: off the emulation"


@needs_kernel
@pytest.mark.parametrize("bits,gs", FORMATS)
@pytest.mark.parametrize("activation_bits", [8, 12, 16])
def test_rms_error_per_format(isa, bits, gs, activation_bits):
    """The documented per-format tolerance on normal data, K = 768."""
    rng = np.random.default_rng(bits + gs)
    triple, w, _ = random_weight(rng, 96, 768, bits, gs)
    x = rng.standard_normal((16, 768)).astype(np.float32)
    (out,) = run(x, qmm.pack(*triple, bits, gs), bits, gs, [96], activation_bits=activation_bits)
    ref = x.astype(np.float64) @ w.astype(np.float64).T  # (16, 96)
    rel = np.sqrt(np.mean((np.array(out) - ref) ** 2)) / np.sqrt(np.mean(ref ** 2))
    assert rel < RMS_TOL[(bits, gs, activation_bits)], f"rms error {rel:.2e} of rms(y)"


@needs_kernel
@pytest.mark.parametrize("bits,gs", [(4, 32), (8, 64)])
def test_fused_outputs_and_float16_scales(isa, bits, gs):
    """Three outputs of odd widths in one packed weight (as q/k/v), scales stored as float16."""
    rng = np.random.default_rng(3)
    widths, k = [20, 7, 33], 256
    parts = [random_weight(rng, n, k, bits, gs) for n in widths]
    halves = [tuple(a.astype(mx.float16) if i else a for i, a in enumerate(p[0])) for p in parts]
    packed = [qmm.pack(*h, bits, gs) for h in halves]
    assert packed[0][1].dtype == mx.float16
    stacked = tuple(mx.concatenate([p[i] for p in packed]) for i in range(3))
    x = rng.standard_normal((11, k)).astype(np.float32)
    outs = run(x, stacked, bits, gs, widths)
    for out, h, n in zip(outs, halves, widths):
        q = np.array(qmm.mlx_ints(h[0], bits)).astype(np.int64)
        emu = emulate(x, q, np.array(h[1].astype(mx.float32)), np.array(h[2].astype(mx.float32)), gs)
        assert out.shape == (11, n)
        np.testing.assert_allclose(np.array(out), emu, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("glu,act", [("silu", lambda g: g / (1 + np.exp(-g))),
                                     ("gelu_pytorch_tanh",
                                      lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))))])
@pytest.mark.parametrize("tokens", [1, 6, 19])
def test_glu_epilogue(isa, glu, act, tokens):
    rng = np.random.default_rng(tokens)
    gate, up = (random_weight(rng, 40, 128, 4, 32) for _ in range(2))
    x = rng.standard_normal((tokens, 128)).astype(np.float32)
    pg, pu = qmm.pack(*gate[0], 4, 32), qmm.pack(*up[0], 4, 32)
    pairs = tuple(mx.stack([a, b], axis=1).reshape(-1, *a.shape[1:]) for a, b in zip(pg, pu))  # gate/up panels
    (out,) = run(x, pairs, 4, 32, [40], glu=qmm.GLU_KINDS[glu])
    g = emulate(x, gate[2], np.array(gate[0][1]), np.array(gate[0][2]), 32)
    u = emulate(x, up[2], np.array(up[0][1]), np.array(up[0][2]), 32)
    np.testing.assert_allclose(np.array(out), act(g) * u, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_many_tokens_and_rows_use_threads(isa):
    """Big enough to spread panels and the quantization over the thread pool."""
    rng = np.random.default_rng(9)
    triple, w, q = random_weight(rng, 1040, 512, 4, 64)
    x = rng.standard_normal((70, 512)).astype(np.float32)
    (out,) = run(x, qmm.pack(*triple, 4, 64), 4, 64, [1040])
    emu = emulate(x, q, np.array(triple[1]), np.array(triple[2]), 64)
    np.testing.assert_allclose(np.array(out), emu, rtol=1e-5, atol=1e-3)


@needs_kernel
def test_each_kernel_set_shapes_its_own_tasks(isa):
    """The kernel set in use decides how quantized_matmul cuts a compute-bound call into tasks (no kernel
    set name is compared anywhere else): AMX panels get token blocks of 64 rows (their tiles reuse each
    unpacked weight chunk across them), the avx512 GEMM (int12 / int16 from 8 tokens) 8 panels per task
    (it packs a task's token block once for all its panels), everything else 16-row blocks of 4 panels."""
    for act_bits in (8, 12, 16):
        for tokens in (7, 8, 9, 15, 16, 512):
            want = (16, 4)
            if isa == "avx512_amx":
                want = (64, 4)
            elif isa == "avx512" and act_bits != 8 and tokens >= 8:
                want = (16, 8)
            assert _ext.load().qmm_task_shape(act_bits, tokens) == want, (isa, act_bits, tokens)


@needs_kernel
@pytest.mark.parametrize("glu", [-1, 0])
def test_decode_split_covers_every_panel_once(isa, glu):
    """One token (16-panel tasks over the threads) against row 0 of a 9-token call (many-token tasks): the
    same tile arithmetic per token, so bit-identical, on odd widths whose panels do not fill the tasks
    (38 + 4 + 17 panels; glu: 19 gate/up pairs and a partial one), big enough to use the threads."""
    rng = np.random.default_rng(31 + glu)
    k = 2048
    widths = [16 * 19 + 3] if glu >= 0 else [16 * 37 + 5, 16 * 3 + 1, 16 * 17]
    parts = [random_weight(rng, n, k, 4, 32) for n in (widths * 2 if glu >= 0 else widths)]
    packed = [qmm.pack(*p[0], 4, 32) for p in parts]
    if glu >= 0:  # gate/up panels interleaved, as the loader packs them
        triple = tuple(mx.stack([a, b], axis=1).reshape(-1, *a.shape[1:]) for a, b in zip(*packed))
    else:
        triple = tuple(mx.concatenate([p[i] for p in packed]) for i in range(3))
    x = rng.standard_normal((9, k)).astype(np.float32)
    one = run(x[:1], triple, 4, 32, widths, glu=glu)
    nine = run(x, triple, 4, 32, widths, glu=glu)
    for a, b, n in zip(one, nine, widths):
        assert a.shape == (1, n)
        np.testing.assert_array_equal(np.array(a), np.array(b[:1]))
    if glu < 0:
        for out, p in zip(one, parts):
            emu = emulate(x[:1], p[2], np.array(p[0][1]), np.array(p[0][2]), 32)
            np.testing.assert_allclose(np.array(out), emu, rtol=1e-5, atol=1e-3)


@needs_kernel
def test_leading_dims_zeros_and_no_tokens(isa):
    rng = np.random.default_rng(2)
    triple, w, q = random_weight(rng, 24, 64, 8, 32)
    packed = qmm.pack(*triple, 8, 32)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    (out,) = run(x, packed, 8, 32, [24])
    assert out.shape == (2, 3, 24)
    np.testing.assert_allclose(np.array(out).reshape(6, 24), emulate(x.reshape(6, 64), q, np.array(triple[1]),
                                                                    np.array(triple[2]), 32), rtol=1e-5, atol=1e-4)
    (zero,) = run(np.zeros((3, 64), np.float32), packed, 8, 32, [24])  # all-zero blocks: d = 0, no NaN
    np.testing.assert_allclose(np.array(zero), 0.0)
    (empty,) = run(np.zeros((0, 64), np.float32), packed, 8, 32, [24])
    assert empty.shape == (0, 24)


@needs_kernel
def test_strided_inputs_are_copied_in_the_task(isa):
    """A transposed x and a sliced id vector: no Contiguous node, the kernel copies them itself."""
    rng = np.random.default_rng(6)
    triple, w, q = random_weight(rng, 40, 96, 4, 32)
    packed = qmm.pack(*triple, 4, 32)
    xt = mx.array(rng.standard_normal((96, 5)).astype(np.float32))
    (out,) = _ext.quantized_matmul(xt.T, *packed, bits=4, group_size=32, columns=[40])
    np.testing.assert_allclose(np.array(out), emulate(np.array(xt).T.copy(), q, np.array(triple[1]),
                                                      np.array(triple[2]), 32), rtol=1e-5, atol=1e-4)
    ids = mx.arange(40, dtype=mx.int32)[::3]
    rows = _ext.quantized_rows(*packed, ids, bits=4, group_size=32, rows=40)
    np.testing.assert_allclose(np.array(rows), w[np.arange(40)[::3]], rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("bits,gs", FORMATS)
def test_quantized_rows_are_the_dequantized_rows(isa, bits, gs):
    rng = np.random.default_rng(4)
    triple, w, _ = random_weight(rng, 37, 256, bits, gs)
    ids = mx.array([[0, 36, 5], [17, 16, 15]], dtype=mx.int32)
    q, s, b = qmm.pack(*triple, bits, gs)
    rows = _ext.quantized_rows(q, s, b, ids, bits=bits, group_size=gs, rows=37)
    assert rows.shape == (2, 3, 256)
    np.testing.assert_allclose(np.array(rows), w[np.array(ids)], rtol=1e-6, atol=1e-6)


@needs_kernel
def test_modules_fuse_quantized_linears():
    """QuantizedLinearCPU over nn.QuantizedLinear (with biases) and QuantizedEmbeddingCPU."""
    rng = np.random.default_rng(5)
    layers = []
    for n in (24, 8, 8):
        linear = nn.Linear(64, n, bias=True)
        linear.weight = mx.array(rng.standard_normal((n, 64)).astype(np.float32))
        linear.bias = mx.array(rng.standard_normal(n).astype(np.float32))
        layers.append(nn.QuantizedLinear.from_linear(linear, group_size=32, bits=4))
    fused = qmm.QuantizedLinearCPU.from_layers(layers)
    x = mx.array(rng.standard_normal((5, 64)).astype(np.float32))
    for got, layer in zip(fused(x), layers):
        np.testing.assert_allclose(np.array(got), np.array(layer(x)), rtol=0.05, atol=0.1)
    embedding = nn.Embedding(50, 64)
    embedding.weight = mx.array(rng.standard_normal((50, 64)).astype(np.float32))
    qe = nn.QuantizedEmbedding.from_embedding(embedding, group_size=32, bits=8)
    cpu = qmm.QuantizedEmbeddingCPU(qe)
    ids = mx.array([3, 49, 0], dtype=mx.int32)
    np.testing.assert_allclose(np.array(cpu(ids)), np.array(qe(ids)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(cpu.as_linear(x)), np.array(qe.as_linear(x)), rtol=0.05, atol=0.1)
    with pytest.raises(ValueError, match="bits"):
        qmm.QuantizedLinearCPU.from_layers([layers[0], nn.QuantizedLinear.from_linear(nn.Linear(64, 8),
                                                                                          group_size=64, bits=8)])


@needs_kernel
def test_blas_crossover_runs_the_same_layers_in_float32(monkeypatch):
    """From BLAS_CROSSOVER rows on (kernel sets where BLAS was measured faster) a module dequantizes
    per call: the same outputs within the kernels' activation error."""
    assert qmm.BLAS_CROSSOVER["avx512"] is None and qmm.BLAS_CROSSOVER["avx2"] is None
    assert qmm.BLAS_CROSSOVER["scalar"] == 2
    _ext.set_cpu_isa("scalar")
    try:
        assert qmm.blas_crossover() == 2
    finally:
        _ext.set_cpu_isa("auto")
    rng = np.random.default_rng(11)
    gate, up = (nn.QuantizedLinear.from_linear(nn.Linear(64, 40, bias=False), group_size=32, bits=4) for _ in "gu")
    fused = qmm.QuantizedLinearCPU.from_layers([gate, up], glu="silu")
    fused.activation_bits = 16  # the bound below is int16's activation error (the default int12's is ~16x)
    x = mx.array(rng.standard_normal((6, 64)).astype(np.float32))
    fused.blas_rows = None
    kernel_out = fused(x)
    fused.blas_rows = 4  # 6 rows >= 4: the BLAS path
    np.testing.assert_allclose(np.array(fused(x)), np.array(kernel_out), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(np.array(fused(x)), np.array(nn.silu(gate(x)) * up(x)), rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 3}, "bits must be 4 or 8"),
    ({"group_size": 16}, "group_size"),
    ({"columns": [40]}, "panels"),
    ({"columns": [16, 0]}, "at least one column"),
    ({"glu": 5}, "glu"),
    ({"x": mx.zeros((2, 65))}, "K=64"),
    ({"x": mx.zeros((2, 64), dtype=mx.float16)}, "float32"),
])
def test_validates_inputs(kwargs, match):
    triple, _, _ = random_weight(np.random.default_rng(0), 32, 64, 4, 32)
    q, s, b = qmm.pack(*triple, 4, 32)
    args = {"x": mx.zeros((2, 64)), "bits": 4, "group_size": 32, "columns": [32], "glu": -1} | kwargs
    with pytest.raises(ValueError, match=match):
        kernel.quantized_matmul(args["x"], q, s, b, bits=args["bits"], group_size=args["group_size"],
                                columns=args["columns"], glu=args["glu"])
    with pytest.raises(ValueError, match="not bits 3"):
        qmm.pack(*triple, 3, 32)


@needs_kernel
def test_isa_choice_and_override():
    assert ISAS[0] == "scalar" and _ext.cpu_isa() == ISAS[-1]  # the best by default
    with pytest.raises(ValueError, match="unknown kernel set"):
        _ext.set_cpu_isa("sse9")
    code = ("import kernels.runtime; from kernels import ext; m = ext.load(); "
            "print(m.cpu_isa() if m else 'refused')")
    env = dict(os.environ, PYTHONPATH=ROOT, METRALE_CPU_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "scalar", out.stderr
    env["METRALE_CPU_ISA"] = "sse9"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "refused" and "unknown kernel set 'sse9'" in out.stderr


@needs_kernel
def test_isa_objects_share_no_symbols_outside_their_namespace():
    """Code compiled with AVX2/AVX-512 flags must not be linker-merged into baseline code: every
    weak (inline) symbol of an ISA object lives in its own metrale::<isa> namespace."""
    sources = {"avx512_amx": "qmm_amx.cpp"}  # the avx512 set's table with AMX panels, its own object
    objects = [isa_object(name, sources.get(name, "isa_kernels.cpp")) for name in ISAS]
    if not all(o.exists() for o in objects):
        pytest.skip("build objects not found (kernels/build)")
    for path, name in zip(objects, ISAS):
        out = subprocess.run(["nm", "-C", path], capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip("nm not available")
        weak = [line for line in out.stdout.splitlines() if line[17:18] in ("W", "V", "u")]
        leaked = [line for line in weak if f"metrale::{name}::" not in line and "__gxx_personality" not in line]
        assert not leaked, f"{name}: {leaked[:5]}"


@needs_kernel
def test_the_avx2_activation_quantizer_packs_its_int8_stores():
    """GCC lowered the quantizer's int32 -> int8 conversion (__builtin_convertvector) for AVX2 to a vpextrd,
    shift and or per value (3x the quantizer's time); store_int8 packs with packssdw / packsswb now."""
    out = avx2_disassembly("_ZN7metrale4avx23qmm8quantizeEPKfRKNS_7QmmActsEll")
    if out is None:
        pytest.skip("no avx2 build object (kernels/build) or no objdump that disassembles one symbol")
    assert "quantize" in out, "the avx2 quantize symbol is gone: update this test"
    packs = sum("packssdw" in line for line in out.splitlines())
    extracts = sum("pextrd" in line for line in out.splitlines())
    assert packs >= 4 and extracts < packs, f"{packs} packssdw, {extracts} pextrd: the int8 stores are scalar again"
