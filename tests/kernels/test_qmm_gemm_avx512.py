"""The avx512 set's many-token path (kernels/csrc/qmm_gemm_avx512.h: tiles of up to 16 tokens, K in
chunks, float accumulators in a buffer) against its few-token tiles and the avx2 set, bit for bit.

A call of T >= 8 tokens takes the GEMM path; the same rows in calls of at most 7 tokens take tile()
(qmm_kernel.h). Both must give the same floats (same int32 block sums, same epilogue in the same order),
and so must avx2 (its own tile(), the same arithmetic on 256 bits). Shapes cover odd T, T past one pass
of 64 tokens, remainders of every tile width, N past one pass of 8 panels and not a multiple of 16, K of
one group and K whose chunks end mid-way, groups 32/64/128, 4 and 8 bits, float16 and float32 scales,
int8/int12/int16 activations and the GLU pairs. Skipped without the avx512 set (CPU or build).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext, qmm
from tests.kernels.isa_helpers import evaluated_on
from tests.kernels.test_quantized_matmul import emulate, random_weight, run

ISAS = ext.supported_isas() if ext.load() is not None else []
needs_avx512 = pytest.mark.skipif("avx512" not in ISAS, reason="needs the avx512 kernel set and CPU")
FORMATS = [(bits, gs) for bits in (4, 8) for gs in (32, 64, 128)]
SMALL = 7  # tokens per call that stay on tile() (qmm_kernel.h: kGemmMinTokens - 1)


def in_small_calls(x, packed, bits, gs, columns, **kw):
    """The outputs of x (T, K) computed SMALL tokens per call, concatenated: tile()'s results."""
    parts = [run(x[t : t + SMALL], packed, bits, gs, columns, **kw) for t in range(0, x.shape[0], SMALL)]
    return [mx.concatenate([p[i] for p in parts]) for i in range(len(columns))]


def outputs_on(isa, *args, **kw):
    return evaluated_on(isa, lambda: (run(*args, **kw), in_small_calls(*args, **kw)))


def assert_same_bits(got, want, what):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert mx.array_equal(g, w).item(), f"{what}: max diff {np.abs(np.array(g) - np.array(w)).max()}"


@needs_avx512
@pytest.mark.parametrize("bits,gs", FORMATS)
@pytest.mark.parametrize("activation_bits", [8, 12, 16])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16])
def test_many_tokens_equal_the_small_tiles_and_avx2(bits, gs, activation_bits, scale_dtype):
    rng = np.random.default_rng(bits * 100 + gs + activation_bits)
    for n, k, tokens in [(149, gs, 17), (149, 640, 45), (37, 640, 130), (16, 384, 16), (5, 640, 31)]:
        triple, _, _ = random_weight(rng, n, k, bits, gs)
        packed = qmm.pack(*triple, bits, gs, scale_dtype=scale_dtype)
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        args = (x, packed, bits, gs, [n])
        big, small = outputs_on("avx512", *args, activation_bits=activation_bits)
        assert_same_bits(big, small, f"avx512 {tokens} tokens vs {SMALL} per call, n={n} k={k}")
        if "avx2" in ISAS:
            big2, _ = outputs_on("avx2", *args, activation_bits=activation_bits)
            assert_same_bits(big, big2, f"avx512 vs avx2, {tokens} tokens, n={n} k={k}")


@needs_avx512
@pytest.mark.parametrize("glu", sorted(qmm.GLU_KINDS))
@pytest.mark.parametrize("activation_bits", [12, 16])
def test_glu_pairs_and_split_outputs_equal_the_small_tiles(glu, activation_bits):
    """83 columns of GLU pairs (6 pairs: two passes of 4) and three fused outputs of odd widths."""
    rng = np.random.default_rng(activation_bits)
    gate, up = (random_weight(rng, 83, 256, 4, 32)[0] for _ in range(2))
    pg, pu = qmm.pack(*gate, 4, 32), qmm.pack(*up, 4, 32)
    pairs = tuple(mx.stack([a, b], axis=1).reshape(-1, *a.shape[1:]) for a, b in zip(pg, pu))
    x = rng.standard_normal((37, 256)).astype(np.float32)
    big, small = outputs_on("avx512", x, pairs, 4, 32, [83], glu=qmm.GLU_KINDS[glu], activation_bits=activation_bits)
    assert_same_bits(big, small, f"glu {glu}")
    widths = [20, 7, 133]
    parts = [qmm.pack(*random_weight(rng, n, 256, 8, 64)[0], 8, 64) for n in widths]
    stacked = tuple(mx.concatenate([p[i] for p in parts]) for i in range(3))
    big, small = outputs_on("avx512", x, stacked, 8, 64, widths, activation_bits=activation_bits)
    assert_same_bits(big, small, "fused outputs")


@needs_avx512
@pytest.mark.parametrize("activation_bits", [8, 12, 16])
def test_prompt_chunk_matches_the_emulation(activation_bits):
    """512 tokens at K = 2048 (several token blocks and passes, the thread pool): within float32 rounding
    of the exact emulation of the same int8 arithmetic."""
    rng = np.random.default_rng(5)
    triple, w, q = random_weight(rng, 48, 2048, 4, 32)
    x = rng.standard_normal((512, 2048)).astype(np.float32)
    (out,) = evaluated_on("avx512", lambda: run(x, qmm.pack(*triple, 4, 32), 4, 32, [48],
                                                activation_bits=activation_bits))
    emu = emulate(x, q, np.array(triple[1]), np.array(triple[2]), 32, activation_bits)
    assert np.all(np.abs(np.array(out) - emu) <= 1e-6 * (np.abs(x) @ np.abs(w).T) + 1e-6)
