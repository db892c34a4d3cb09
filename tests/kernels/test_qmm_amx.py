"""The AMX int8 tile panels (kernels/csrc/qmm_amx.cpp, kernel set avx512_amx) at prompt-chunk sizes:
exact against the float64 emulation of the kernels' arithmetic, and bit-identical to the avx512 set
(same int8 block sums, same float order). Skipped where the CPU has no AMX-INT8 or Linux refuses the
tile state (then supported_isas() lacks avx512_amx); the rest of the kernel tests run every set this
CPU has, avx512_amx included, through the `isa` fixture."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext as _ext
from kernels import qmm
from tests.kernels.isa_helpers import evaluated_on as on
from tests.kernels.test_quantized_matmul import emulate, random_weight, run

needs_amx = pytest.mark.skipif(_ext.load() is None or "avx512_amx" not in _ext.supported_isas(),
                               reason="no AMX-INT8 on this CPU (or the kernel refused the tile state)")


@needs_amx
@pytest.mark.parametrize("k", [704, 2048, 8192])
@pytest.mark.parametrize("tokens", [16, 17, 64, 100, 512])
@pytest.mark.parametrize("bits,gs,activation_bits", [(4, 32, 8), (4, 32, 12), (4, 32, 16), (8, 64, 8), (8, 64, 12)])
def test_prompt_chunks_match_emulation_and_avx512(k, tokens, bits, gs, activation_bits):
    """Whole tiles of 16 tokens on AMX, the rest (17, 100) on the avx512 tile, one partial panel (N = 40)."""
    rng = np.random.default_rng(k + tokens + bits + activation_bits)
    n = 40
    triple, w, q = random_weight(rng, n, k, bits, gs)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    packed = qmm.pack(*triple, bits, gs, mx.float16)
    amx = np.array(on("avx512_amx", lambda: run(x, packed, bits, gs, [n], activation_bits=activation_bits)[0]))
    emu = emulate(x, q, np.array(packed[1]).transpose(0, 2, 1).reshape(-1, k // gs)[:n],
                  np.array(packed[2]).transpose(0, 2, 1).reshape(-1, k // gs)[:n], gs, activation_bits)
    assert np.all(np.abs(amx - emu) <= 1e-6 * (np.abs(x) @ np.abs(w).T) + 1e-6), "off the emulation"
    avx512 = np.array(on("avx512", lambda: run(x, packed, bits, gs, [n], activation_bits=activation_bits)[0]))
    assert np.array_equal(amx, avx512)


@needs_amx
@pytest.mark.parametrize("n", [72, 104])
@pytest.mark.parametrize("activation_bits", [8, 12, 16])
@pytest.mark.parametrize("bits,gs", [(4, 64), (4, 128), (8, 32), (8, 128)])
def test_chunk_remainders_and_passes_equal_avx512(bits, gs, activation_bits, n):
    """K = 640 is two weight chunks of 8 blocks plus 4; 345 tokens are token blocks of 304 (144 with int16,
    qmm.cpp) cut into passes of at most 8 tiles of 16, and 9 tokens left to the avx512 tile; float32
    scales; N = 72 and 104 are 5 and 7 panels (the last one partial): groups of 4 and 1, 4 and 3."""
    rng = np.random.default_rng(bits + gs + activation_bits)
    k, tokens = 640, 345
    triple, _, _ = random_weight(rng, n, k, bits, gs)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    packed = qmm.pack(*triple, bits, gs, mx.float32)
    outs = [np.array(on(isa, lambda: run(x, packed, bits, gs, [n], activation_bits=activation_bits)[0]))
            for isa in ("avx512", "avx512_amx")]
    assert np.array_equal(*outs)


@needs_amx
@pytest.mark.parametrize("glu", [0, 1])
def test_glu_pairs_and_fused_outputs_equal_avx512(glu):
    """gate/up panel pairs with the activation epilogue (3 pairs: a group of two and one alone), and
    two outputs in one call (q/k/v style)."""
    rng = np.random.default_rng(glu)
    k, tokens = 512, 48
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    gate, _, _ = random_weight(rng, 40, k, 4, 32)
    up, _, _ = random_weight(rng, 40, k, 4, 32)
    layers = [qmm.pack(*gate, 4, 32), qmm.pack(*up, 4, 32)]
    paired = tuple(mx.contiguous(mx.stack([g, u], axis=1).reshape(-1, *g.shape[1:])) for g, u in zip(*layers))
    fused = tuple(mx.concatenate([layer[i] for layer in layers]) for i in range(3))
    for packed, columns, glu_code in ((paired, [40], glu), (fused, [40, 40], -1)):
        outs = {isa: [np.array(o) for o in on(isa, lambda: run(x, packed, 4, 32, columns, glu=glu_code,
                                                                  activation_bits=8))]
                for isa in ("avx512", "avx512_amx")}
        for a, b in zip(outs["avx512"], outs["avx512_amx"]):
            assert np.array_equal(a, b)


@needs_amx
def test_amx_is_the_default_and_can_be_forced_off():
    assert _ext.cpu_isa() == "avx512_amx"
    assert on("avx512", _ext.cpu_isa) == "avx512"  # METRALE_CPU_ISA=avx512: the same kernels without AMX
    assert _ext.cpu_isa() == "avx512_amx"  # "auto" restores the best set
