"""The top_k / top_p sampling kernel (sample_candidates_rows) against a float64 statement of its rule and against
metrale.sampling.ops' MLX reference, and the top-n ids kernel (top_ids_rows) against ops.largest, on every
instruction set (the `isa` fixture): random rows, ties at the k-th value and at the top_p cut, -inf and NaN
logits, k = 1 / k = V, top_p tiny / 1.0, min_p, large k, extreme temperatures; and a whole 32 x 128256 batch
through Sampler with either backend (skipped when the kernels are not built)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext as _ext
from kernels.sampling import LOG2E
from metrale.sampling import ops
from metrale.sampling.batch import BatchBuilder
from metrale.sampling.sampler import Sampler
from metrale.sampling_params import SamplingParams

kernel = _ext.load()
needs_kernel = pytest.mark.skipif(kernel is None or not hasattr(kernel, "sample_candidates_rows"),
                                  reason="kernels not built: python -m kernels.build")
MARGIN = 1e-5  # rows whose uniform or top_p lies this close (relative) to a token boundary are not compared


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


def rule(x: np.ndarray, temperature: float, min_p: float, top_k: int, top_p: float, u: float) -> tuple[int, float]:
    """(token, margin) of one row by the kernel's rule in float64 (kernels/csrc/sampling_select.h): y in float32
    as the reference, descending order y, x, then index; margin: the relative distance of u and top_p to the
    nearest running-mass boundary."""
    numbers = np.nonzero(~np.isnan(x))[0]
    m = x[numbers].max()
    y = ((x - m) * np.float32(LOG2E / temperature)).astype(np.float32)
    order = numbers[np.lexsort((numbers, -x[numbers], -y[numbers]))]
    ys = y[order].astype(np.float64)
    q = np.where(ys >= max(math.log2(min_p) if min_p > 0 else -math.inf, -126.0), np.exp2(ys), 0.0)
    if 0 < top_k < len(numbers):
        q = np.where(ys >= ys[top_k - 1], q, 0.0)
    cum = np.cumsum(q)
    total = cum[-1]
    margin = 1.0
    kept = total
    if top_p < 1.0:
        end = int(np.searchsorted(cum, top_p * total))
        kept = cum[end]
        margin = min(abs(cum[max(end - 1, 0)] - top_p * total), abs(kept - top_p * total)) / total
    token = int(np.searchsorted(cum, u * kept))
    margin = min(margin, abs(cum[token] - u * kept) / kept, abs(cum[token - 1] - u * kept) / kept if token else 1.0)
    return int(order[token]), margin


def run_kernel(x: np.ndarray, temperature: float, min_p: float, top_k: int, top_p: float,
               uniforms: np.ndarray) -> np.ndarray:
    rows = x.shape[0]

    def per_row(value: float, dtype=mx.float32) -> mx.array:
        return mx.array(np.full(rows, value), dtype=dtype)

    tokens = kernel.sample_candidates_rows(mx.array(x), per_row(LOG2E / temperature),
                                           per_row(math.log2(min_p) if min_p > 0 else -math.inf),
                                           per_row(top_k, mx.int32), per_row(top_p if top_p < 1 else math.inf),
                                           mx.array(uniforms.astype(np.float32)))
    assert tokens.dtype == mx.int32 and tokens.shape == (rows,)
    return np.array(tokens)


def run_reference(x: np.ndarray, params: list[SamplingParams]) -> tuple[np.ndarray, np.ndarray]:
    """The MLX ops' tokens and the rows' uniforms (seeded params)."""
    rows = [Row(p) for p in params]
    group = BatchBuilder(x.shape[1], (), 0).build(rows).candidates
    return np.array(ops.sample_candidates(mx.array(x), group, x.shape[1])), np.array(group.uniforms)


CASES = [  # temperature, min_p, top_k, top_p
    (1.0, 0.0, 40, 1.0), (0.8, 0.0, 50, 0.9), (1.0, 0.0, 0, 0.9), (0.7, 0.05, 0, 0.95), (1.3, 0.02, 20, 1.0),
    (2.0, 0.0, 0, 0.5), (1.0, 0.0, 1, 1.0), (1.0, 0.0, 0, 1e-6),
]


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("spread", [3.0, 0.3], ids=["peaked", "flat"])
def test_random_rows_match_the_rule_and_the_reference(isa, case, spread):
    temperature, min_p, top_k, top_p = case
    x = (np.random.default_rng(int(spread * 10) + top_k).standard_normal((48, 3000)) * spread).astype(np.float32)
    params = [SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p, seed=s) for s in range(48)]
    reference, uniforms = run_reference(x, params)
    got = run_kernel(x, temperature, min_p, top_k, top_p, uniforms)
    compared = 0
    for i in range(len(x)):
        token, margin = rule(x[i], temperature, min_p, top_k, top_p, float(uniforms[i]))
        if margin > MARGIN:
            assert got[i] == token == reference[i], (i, got[i], token, reference[i])
            compared += 1
    assert compared >= 36


@needs_kernel
def test_values_tied_with_the_kth_all_survive_in_index_order():
    x = np.zeros((1, 1000), dtype=np.float32)
    x[0, 500] = 5.0
    tied = [3, 100, 200, 700, 999]  # the 2nd..6th largest, tied: top_k 3 keeps all five
    x[0, tied] = 4.0
    uniforms = np.linspace(0.001, 0.999, 400)
    got = run_kernel(np.repeat(x, len(uniforms), axis=0), 1.0, 0.0, 3, 1.0, uniforms)
    assert set(got) == {500, *tied}
    expected = [rule(x[0], 1.0, 0.0, 3, 1.0, float(u))[0] for u in uniforms]
    np.testing.assert_array_equal(got, expected)
    assert list(dict.fromkeys(got)) == [500, *tied]  # the descending order: ties by index


@needs_kernel
@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.5), (40, 0.9), (7, 1.0), (1, 1.0)])
def test_integer_logits_with_many_ties(isa, top_k, top_p):
    # top_p alone: V = 64 < its 256 candidates, so the reference sorts the whole row (stable): its ties go lower
    # index first, as the kernel's. With top_k the reference keeps only the ties among its K candidates: the rule.
    x = np.round(np.random.default_rng(top_k).standard_normal((64, 64)) * 2).astype(np.float32)
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=s) for s in range(64)]
    reference, uniforms = run_reference(x, params)
    got = run_kernel(x, 1.0, 0.0, top_k, top_p, uniforms)
    compared = 0
    for i in range(len(x)):
        token, margin = rule(x[i], 1.0, 0.0, top_k, top_p, float(uniforms[i]))
        if margin > MARGIN:
            assert got[i] == token, i
            assert top_k or got[i] == reference[i], i
            compared += 1
    assert compared >= 48


@needs_kernel
def test_a_tiny_top_p_keeps_the_first_of_the_tied_maxima():
    x = np.array([[1.0, 3.0, 2.0, 3.0, 3.0] * 20], dtype=np.float32)
    got = run_kernel(np.repeat(x, 3, axis=0), 1.0, 0.0, 0, 1e-6, np.array([0.01, 0.5, 0.99]))
    np.testing.assert_array_equal(got, [1, 1, 1])


@needs_kernel
def test_infinities_and_nans(isa):
    inf, nan = math.inf, math.nan
    rows = np.array([
        [-inf] * 6,                       # no number with mass: the first index (the reference's top candidate)
        [0.0, inf, 1.0, inf, 2.0, 3.0],   # +inf: the first one
        [-inf, 2.0, -inf, 1.0, -inf, 2.0],
        [nan, 2.0, nan, 1.0, 0.5, 2.0],   # NaN: no mass, after every number
        [nan] * 6,
    ], dtype=np.float32)
    uniforms = np.full(len(rows), 0.7)
    for top_k, top_p in [(2, 1.0), (0, 0.9), (3, 0.8)]:
        got = run_kernel(rows, 1.0, 0.0, top_k, top_p, uniforms)
        assert got[0] == 0 and got[1] == 1 and got[4] == 0
        as_minus_inf = np.where(np.isnan(rows[3]), -inf, rows[3]).astype(np.float32)
        assert got[3] == run_kernel(as_minus_inf[None], 1.0, 0.0, top_k, top_p, uniforms[:1])[0]
        for i in (2, 3):
            assert got[i] == rule(rows[i], 1.0, 0.0, top_k, top_p, 0.7)[0]


@needs_kernel
@pytest.mark.parametrize("top_k", [1, 2999, 3000, 5000])
def test_k_of_one_is_the_argmax_and_k_of_v_keeps_everything(top_k):
    x = (np.random.default_rng(top_k).standard_normal((16, 3000)) * 2).astype(np.float32)
    uniforms = np.random.default_rng(1).uniform(0.01, 0.99, 16)
    got = run_kernel(x, 1.0, 0.05, top_k, 1.0, uniforms)
    if top_k == 1:
        np.testing.assert_array_equal(got, x.argmax(axis=1))
    for i in range(len(x)):
        token, margin = rule(x[i], 1.0, 0.05, top_k, 1.0, float(uniforms[i]))
        if margin > MARGIN:
            assert got[i] == token


@needs_kernel
def test_bad_arguments_raise():
    x = mx.zeros((2, 8))
    f32, i32 = mx.zeros((2,)), mx.zeros((2,), dtype=mx.int32)
    with pytest.raises(ValueError, match="sample_candidates_rows"):
        kernel.sample_candidates_rows(x, f32, f32, f32, f32, f32)  # top_k must be int32
    with pytest.raises(ValueError, match="sample_candidates_rows"):
        kernel.sample_candidates_rows(x, mx.zeros((3,)), f32, i32, f32, f32)
    with pytest.raises(ValueError, match="top_ids_rows"):
        kernel.top_ids_rows(x, 9)
    with pytest.raises(ValueError, match="top_ids_rows"):
        kernel.top_ids_rows(x, 0)


@needs_kernel
@pytest.mark.parametrize("shape,n", [((8, 5000), 20), ((3, 128256), 5), ((4, 30), 30), ((5, 100), 1), ((2, 40), 20)])
def test_top_ids_match_largest(isa, shape, n):
    x = np.random.default_rng(n).standard_normal(shape).astype(np.float32)
    want_values, want_ids = ops.largest(mx.array(x), n)
    ids = kernel.top_ids_rows(mx.array(x), n)
    assert ids.dtype == mx.int32 and ids.shape == (shape[0], n)
    np.testing.assert_array_equal(np.array(ids), np.array(want_ids))
    values, _ = ops.largest(mx.array(x), n, kernel.top_ids_rows)
    np.testing.assert_array_equal(np.array(values), np.array(want_values))


@needs_kernel
def test_top_ids_ties_nans_and_strided_input(isa):
    x = np.array([[1.0, math.nan, 3.0, 3.0, -math.inf, 2.0, 3.0, math.nan]], dtype=np.float32)
    np.testing.assert_array_equal(np.array(kernel.top_ids_rows(mx.array(x), 8)), [[2, 3, 6, 5, 0, 4, 1, 7]])
    np.testing.assert_array_equal(np.array(kernel.top_ids_rows(mx.array(x), 8)),
                                  np.array(mx.argsort(-mx.array(x), axis=-1)))
    y = np.random.default_rng(5).standard_normal((300, 6)).astype(np.float32)
    np.testing.assert_array_equal(np.array(kernel.top_ids_rows(mx.array(y).T, 4)), np.argsort(-y.T, axis=1)[:, :4])


def lm_like(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    ranks = np.arange(1, vocab + 1)
    return np.stack([(-1.6 * np.log(ranks) + rng.normal(0, 0.3, vocab))[rng.permutation(vocab)] + 12
                     for _ in range(rows)]).astype(np.float32)


@needs_kernel
def test_a_llama3_sized_batch_samples_the_same_tokens_with_either_backend():
    rng = np.random.default_rng(0)
    logits = mx.array(lm_like(rng, 32, 128256))  # (32, 128256)
    kinds = [dict(top_k=40), dict(top_k=50, top_p=0.9), dict(top_p=0.9), dict(top_p=0.95, min_p=0.05),
             dict(temperature=0.0), dict(top_p=0.9, logprobs=5), dict(temperature=0.8), dict(top_k=5, logprobs=20)]
    rows = [Row(SamplingParams(seed=100 + i, **kinds[i % len(kinds)])) for i in range(32)]
    outputs = [Sampler(128256, seed=0, backend=b)(logits, rows) for b in ("kernel", "reference")]
    assert outputs[0].token_ids == outputs[1].token_ids
    for got, want in zip(*(o.logprobs for o in outputs)):
        assert (got is None) == (want is None)
        if got is not None:
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
            # the reference's float32 normalizer is ~5e-4 off at V = 128256 (the kernel's: ~1e-6)
            np.testing.assert_allclose([v for _, v in got.top], [v for _, v in want.top], atol=2e-3)


@needs_kernel
@pytest.mark.parametrize("case", [  # temperature, min_p, top_k, top_p, spread of the logits
    (1.0, 0.0, 5000, 1.0, 1.0),   # k > V / 256: smaller blocks for the bound
    (1.0, 0.0, 19999, 0.9, 1.0),
    (1.0, 1.0, 0, 0.9, 1.0),      # min_p 1: only the maximum has mass
    (0.01, 0.0, 0, 0.9, 1.0), (0.01, 0.0, 40, 0.9, 1.0), (100.0, 0.0, 0, 0.99, 1.0),
    (1.0, 0.0, 0, 0.9, 1e-6), (1.0, 0.0, 5, 0.9, 1e-6),  # nearly equal logits: one bucket, values of one y
    (1.0, 0.5, 100, 0.3, 3.0),
], ids=str)
def test_large_k_extreme_temperatures_and_nearly_equal_logits(isa, case):
    temperature, min_p, top_k, top_p, spread = case
    rng = np.random.default_rng(top_k)
    x = (rng.standard_normal((6, 20000)) * spread).astype(np.float32)
    uniforms = rng.uniform(0.001, 0.999, 6)
    got = run_kernel(x, temperature, min_p, top_k, top_p, uniforms)
    for i in range(len(x)):
        token, margin = rule(x[i], temperature, min_p, top_k, top_p, float(uniforms[i]))
        if margin > MARGIN:
            assert got[i] == token, i


@needs_kernel
@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (40, 0.9), (40, 1.0)])
def test_nan_logits_get_no_mass_in_wide_rows(isa, top_k, top_p):
    # the rule, and the same tokens as with -inf in their place. (The MLX reference agrees only while no NaN
    # falls among its K candidates: one that does makes its k-th log2_q NaN, no candidate passes that floor,
    # and the row turns greedy.)
    x = (np.random.default_rng(top_k).standard_normal((32, 5000)) * 2).astype(np.float32)
    x[:, [3, 17, 4000]] = math.nan
    uniforms = np.random.default_rng(1).uniform(0.001, 0.999, 32)
    got = run_kernel(x, 1.0, 0.0, top_k, top_p, uniforms)
    np.testing.assert_array_equal(got, run_kernel(np.nan_to_num(x, nan=-math.inf), 1.0, 0.0, top_k, top_p, uniforms))
    for i in range(len(x)):
        token, margin = rule(x[i], 1.0, 0.0, top_k, top_p, float(uniforms[i]))
        if margin > MARGIN:
            assert got[i] == token, i
