"""The batched sampler against numpy references: greedy, masks, seeds, penalties, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest

from kernels.sampling import has_argmax_kernel
from metrale.sampling.sampler import TOP_P_CANDIDATES, Sampler, seeded_bits
from metrale.sampling_params import SamplingParams

V = 49152  # the default model's vocabulary: exercises the two-level candidate search
EOS = 2


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [5, 6, 7])
    output_token_ids: list[int] = field(default_factory=list)


def logits(rows: int, vocab: int = V, scale: float = 3.0, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)  # (S, V)


def sample(x: np.ndarray, rows: list[Row], sampler: Sampler | None = None):
    sampler = sampler or Sampler(x.shape[1], eos_token_ids=(EOS,), seed=0)
    return sampler(mx.array(x), rows)


def reference_probs(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """vLLM order in float64: temperature -> min_p, top_k -> top_p on the renormalized survivors."""
    logit = x.astype(np.float64) / p.temperature  # (V,)
    probs = np.exp(logit - logit.max())
    probs /= probs.sum()
    keep = probs >= p.min_p * probs.max()
    if 0 < p.top_k < len(x):
        keep &= logit >= np.sort(logit)[::-1][p.top_k - 1]
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        exclusive = np.cumsum(sorted_probs) - sorted_probs
        nucleus = np.zeros_like(keep)
        nucleus[order[exclusive < p.top_p]] = True
        probs = np.where(nucleus, probs, 0.0)
        probs /= probs.sum()
    return probs


def uniform(seed: int, position: int) -> float:
    return (seeded_bits(seed, position) + 0.5) / (1 << 24)


def inverse_cdf(probs: np.ndarray, u: float, params: SamplingParams) -> tuple[np.ndarray, int, float]:
    """The walk order, the reference position at u and u's distance to the nearest interval edge.

    Rows with top_k or top_p walk their candidates in descending order, the others the vocabulary in
    id order (the sampler's inverse CDF does the same, in float32).
    """
    truncated = params.top_p < 1.0 or 0 < params.top_k < len(probs)
    order = np.argsort(-probs, kind="stable") if truncated else np.arange(len(probs))
    cdf = np.cumsum(probs[order])
    position = int(np.searchsorted(cdf, u * cdf[-1], side="left"))
    return order, position, float(np.min(np.abs(cdf - u * cdf[-1])))


def test_temperature_zero_equals_top_k_one_equals_argmax():
    x = logits(8)
    greedy = sample(x, [Row(SamplingParams(temperature=0.0)) for _ in range(8)]).token_ids
    top1 = sample(x, [Row(SamplingParams(temperature=1.0, top_k=1, seed=i)) for i in range(8)]).token_ids
    mixed = sample(x, [Row(SamplingParams(temperature=0.0 if i % 2 else 0.7, top_k=1)) for i in range(8)]).token_ids
    assert greedy == top1 == mixed == x.argmax(axis=1).tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=2.0, top_p=0.5),
], ids=["temperature", "top_k", "top_k+top_p", "top_p+min_p", "min_p", "hot_top_p"])
def test_masks_and_sampling_match_numpy_reference(params):
    x = logits(12, scale=2.0, seed=1)
    rows = [Row(SamplingParams(**{**params.to_dict(), "seed": 100 + i}), output_token_ids=[9] * i)
            for i in range(12)]
    tokens = sample(x, rows).token_ids
    for i, token in enumerate(tokens):
        probs = reference_probs(x[i], rows[i].params)
        order, expected, margin = inverse_cdf(probs, uniform(100 + i, i), rows[i].params)
        assert probs[token] > 0, f"row {i}: token {token} is outside the reference support"
        position = int(np.nonzero(order == token)[0][0])
        # float32 running sums drift by up to ~1e-4 over thousands of tokens: a neighbour then wins
        assert position == expected or (margin < 2e-4 and abs(position - expected) <= 2), \
            f"row {i}: position {position} != {expected} (margin {margin:.2g})"


def test_top_p_nucleus_larger_than_the_candidates_falls_back_exactly():
    x = logits(2, scale=0.05, seed=2)  # nearly flat: the 0.9 nucleus holds ~44k tokens
    rows = [Row(SamplingParams(temperature=1.0, top_p=0.9, seed=s)) for s in (1, 2)]
    tokens = sample(x, rows).token_ids
    for i, token in enumerate(tokens):
        probs = reference_probs(x[i], rows[i].params)
        assert np.count_nonzero(probs) > TOP_P_CANDIDATES
        assert probs[token] > 0


def test_seeded_rows_reproduce_alone_and_inside_a_batch():
    target = logits(1, scale=1.0, seed=3)[0]  # (V,)
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=8),
              SamplingParams(temperature=1.1, top_p=0.8, min_p=0.01, seed=9),
              SamplingParams(temperature=1.0, seed=10, repetition_penalty=1.2, frequency_penalty=0.3)]
    others = [SamplingParams(temperature=t, top_k=k, seed=s) for t, k, s in
              [(0.0, 0, None), (1.0, 0, None), (0.5, 20, 3), (1.5, 0, None)] * 4]  # 16 others
    for position in range(4):
        history = list(range(100, 100 + position))
        alone = [sample(target[None], [Row(p, output_token_ids=history)]).token_ids[0] for p in params]
        x = logits(16 + len(params), scale=1.0, seed=10 + position)
        slots = [3, 8, 12, 19]  # where the seeded rows sit in the batch of 20
        rows = [Row(p, output_token_ids=[1, 2]) for p in others]
        for slot, p in zip(slots, params):
            x[slot] = target
            rows.insert(slot, Row(p, output_token_ids=history))
        batched = sample(x, rows, Sampler(V, seed=position)).token_ids
        assert [batched[s] for s in slots] == alone, f"position {position}"


def test_different_seeds_differ_and_unseeded_rows_vary():
    x = np.repeat(logits(1, scale=0.5, seed=4), 8, axis=0)  # 8 identical rows
    tokens = sample(x, [Row(SamplingParams(temperature=1.0, seed=s)) for s in range(8)]).token_ids
    assert len(set(tokens)) >= 6
    again = sample(x, [Row(SamplingParams(temperature=1.0, seed=s)) for s in range(8)]).token_ids
    assert again == tokens
    unseeded = sample(x, [Row(SamplingParams(temperature=1.0)) for _ in range(8)]).token_ids
    assert len(set(unseeded)) >= 6


def reference_penalized(x: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    out = x.astype(np.float64).copy()
    seen = set(output) | (set(prompt) if p.repetition_penalty != 1.0 else set())
    for token in seen:
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(output):
        out[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return out


def test_penalties_match_reference_and_change_outputs():
    x = logits(6, scale=1.0, seed=5)
    prompt, output = [11, 12, 13], [20, 20, 20, 21]
    x[:, 20] += 6.0  # the repeated token is everyone's argmax...
    x[:, 12] += 5.5  # ...and a prompt token is the runner-up
    cases = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=2.0),
             SamplingParams(temperature=0.0, frequency_penalty=1.0),
             SamplingParams(temperature=0.0, presence_penalty=2.0),
             SamplingParams(temperature=0.0, repetition_penalty=0.5, presence_penalty=-1.0),
             SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5)]
    rows = [Row(p, prompt_token_ids=prompt, output_token_ids=output) for p in cases]
    tokens = sample(x, rows).token_ids
    expected = [int(np.argmax(reference_penalized(x[i], p, prompt, output))) for i, p in enumerate(cases)]
    assert tokens == expected
    assert tokens[0] == 20 and tokens[1] != 20 and tokens[2] != 20 and tokens[3] != 20


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    x = logits(3, seed=6)
    x[:, EOS] = 50.0
    x[:, 77] = 40.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[77], max_tokens=8)
    rows = [Row(params, output_token_ids=[]), Row(params, output_token_ids=[1, 1]),
            Row(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), output_token_ids=[1])]
    tokens = sample(x, rows).token_ids
    assert tokens[0] not in (EOS, 77) and tokens[1] == EOS and tokens[2] == EOS


def log_softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64)
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


def test_logprobs_are_the_raw_log_softmax():
    x = logits(4, seed=7)
    rows = [Row(SamplingParams(temperature=0.0, logprobs=5)), Row(SamplingParams(temperature=0.0)),
            Row(SamplingParams(temperature=0.8, top_k=10, logprobs=0, repetition_penalty=1.5, seed=3),
                output_token_ids=[int(np.argmax(x[2]))]),
            Row(SamplingParams(temperature=1.0, top_p=0.9, logprobs=20, seed=4))]
    out = sample(x, rows)
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        reference = log_softmax(x[i])
        entry = out.logprobs[i]
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(reference[entry.token_id], abs=1e-4)
        n = rows[i].params.logprobs
        assert [t for t, _ in entry.top] == np.argsort(-reference)[:n].tolist()
        assert np.allclose([lp for _, lp in entry.top], np.sort(reference)[::-1][:n], atol=1e-4)


def test_small_vocabulary_and_plain_greedy_fast_path():
    x = logits(5, vocab=40, seed=8)
    sampler = Sampler(40, seed=0)
    batch = sampler.prepare([Row(SamplingParams(temperature=0.0)) for _ in range(5)])
    assert batch.is_plain_greedy
    assert sampler.sample(mx.array(x), batch).token_ids == x.argmax(axis=1).tolist()
    rows = [Row(SamplingParams(temperature=1.0, top_k=k, top_p=p, seed=i))
            for i, (k, p) in enumerate([(5, 1.0), (20, 0.5), (0, 0.3), (39, 1.0), (100, 0.99)])]
    for i, token in enumerate(sampler(mx.array(x), rows).token_ids):
        assert reference_probs(x[i], rows[i].params)[token] > 0


def test_logits_rows_must_match_the_batch():
    sampler = Sampler(40)
    batch = sampler.prepare([Row(SamplingParams())])
    with pytest.raises(ValueError, match="rows"):
        sampler.sample(mx.zeros((2, 40)), batch)


@pytest.mark.skipif(not has_argmax_kernel(), reason="kernels not built: python -m kernels.build")
def test_argmax_kernel_samples_the_same_tokens_as_mlx():
    x = np.round(logits(32, scale=4.0, seed=11))  # integer logits: ties for the maximum in most rows
    x[3, 100] = np.nan  # a NaN row: mx.argmax takes its first NaN, and so must the kernel
    plain = [Row(SamplingParams(temperature=0.0)) for _ in range(32)]
    mixed = [Row(SamplingParams(temperature=0.0 if i % 3 else 0.9, min_p=0.05 * (i % 2), seed=i))
             for i in range(32)]
    for rows in (plain, mixed):
        kernel = sample(x, rows, Sampler(V, eos_token_ids=(EOS,), seed=0, backend="kernel")).token_ids
        reference = sample(x, rows, Sampler(V, eos_token_ids=(EOS,), seed=0, backend="reference")).token_ids
        assert kernel == reference
    assert kernel[0] == int(np.argmax(x[0]))
