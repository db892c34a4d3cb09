"""Token masks in the batched sampler: bitmask rows, logit_bias, allowed_token_ids, bad words; rows
without masks sample exactly as before."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest

from metrale.sampling.batch import bad_word_bans
from metrale.sampling.constraints import TokenConstraints
from metrale.sampling.ops import apply_bitmask
from metrale.sampling.sampler import Sampler
from metrale.sampling_params import SamplingParams

V = 1000
EOS = 2


@dataclass
class Row:
    params: SamplingParams
    request_id: str = "r"
    prompt_token_ids: list[int] = field(default_factory=lambda: [5, 6, 7])
    output_token_ids: list[int] = field(default_factory=list)


def logits(rows: int, vocab: int = V, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * 3).astype(np.float32)  # (S, V)


def run(x: np.ndarray, rows: list[Row], sampler: Sampler | None = None, constraints: TokenConstraints | None = None):
    sampler = sampler or Sampler(x.shape[1], eos_token_ids=(EOS,), seed=0)
    masks = (constraints or TokenConstraints(x.shape[1])).prepare(rows)
    return sampler.sample(mx.array(x), sampler.prepare(rows, masks.bitmask)).token_ids


def random_bitmask(rows: int, vocab: int, seed: int) -> np.ndarray:
    words = (vocab + 31) // 32
    return np.random.default_rng(seed).integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)


def allowed_of(mask: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)  # (R, V)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("vocab", [V, 49152, 33])
def test_bitmask_matches_numpy(dtype, vocab):
    x = logits(6, vocab)
    mask = random_bitmask(6, vocab, seed=vocab)
    mask[[0, 3]] = -1  # rows without a constraint: all ones
    out = np.array(apply_bitmask(mx.array(x).astype(dtype), mx.array(mask)).astype(mx.float32))
    keep = allowed_of(mask, vocab)
    assert np.all(np.isneginf(out[~keep])) and np.allclose(out[keep], x[keep], rtol=1e-2)
    assert np.allclose(out[[0, 3]], x[[0, 3]], rtol=1e-2)


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_the_argmax():
    x = logits(2)
    top = int(x[1].argmax())
    rows = [Row(SamplingParams(temperature=0, logit_bias={17: 100})),
            Row(SamplingParams(temperature=0, logit_bias={top: -100}))]
    tokens = run(x, rows)
    assert tokens[0] == 17 and tokens[1] != top and tokens[1] == int(np.argsort(x[1])[-2])


def test_allowed_token_ids_restrict_every_sample():
    allowed = (3, 50, 99, 700)
    rows = [Row(SamplingParams(temperature=1.0, allowed_token_ids=allowed), request_id=f"r{i}") for i in range(8)]
    rows.append(Row(SamplingParams(temperature=0), request_id="free"))
    for seed in range(10):
        x = logits(9, seed=seed)
        tokens = run(x, rows, Sampler(V, eos_token_ids=(EOS,), seed=seed))
        assert all(t in allowed for t in tokens[:8])
        assert tokens[8] == int(x[8].argmax())  # the unconstrained row in the same batch is untouched


def test_bad_word_bans_follow_vllm():
    words = [(7,), (3, 4), (1, 2, 9)]
    assert bad_word_bans(words, []) == [7]  # only one-token words can be completed at the start
    assert bad_word_bans(words, [5, 3]) == [7, 4]
    assert bad_word_bans(words, [1, 2]) == [7, 9]
    assert bad_word_bans(words, [2, 1]) == [7]


def test_bad_words_never_appear_in_a_greedy_loop():
    rng = np.random.default_rng(3)
    x = logits(1, seed=3)[0]
    favourite = [int(i) for i in np.argsort(x)[-3:]]  # greedy would repeat the argmax forever
    word = (favourite[-1], favourite[-1])  # ban repeating it
    sampler = Sampler(V, eos_token_ids=(EOS,), seed=0)
    row = Row(SamplingParams(temperature=0, bad_words_token_ids=[word, (favourite[-2],)]))
    for _ in range(12):
        noisy = x + rng.standard_normal(V).astype(np.float32) * 1e-3
        row.output_token_ids.append(run(noisy[None], [row], sampler)[0])
    out = row.output_token_ids
    assert favourite[-2] not in out
    assert all(out[i:i + 2] != list(word) for i in range(len(out) - 1))


def test_masked_rows_keep_raw_logprobs_and_unmasked_rows_sample_as_before():
    x = logits(4)
    plain = [Row(SamplingParams(temperature=0.8, seed=i, logprobs=2), request_id=f"p{i}") for i in range(4)]
    before = Sampler(V, eos_token_ids=(EOS,), seed=0)(mx.array(x), plain)
    only_9 = Row(SamplingParams(temperature=0.8, seed=2, logprobs=2, allowed_token_ids=(9,)), request_id="m")
    mixed = [*plain[:2], only_9, plain[3]]
    constraints = TokenConstraints(V)
    masks = constraints.prepare(mixed)
    sampler = Sampler(V, eos_token_ids=(EOS,), seed=0)
    after = sampler.sample(mx.array(x), sampler.prepare(mixed, masks.bitmask))
    assert after.token_ids[2] == 9
    assert [after.token_ids[i] for i in (0, 1, 3)] == [before.token_ids[i] for i in (0, 1, 3)]
    raw = x[2] - np.log(np.exp(x[2] - x[2].max()).sum()) - x[2].max()  # log_softmax of the unmasked row
    assert after.logprobs[2].logprob == pytest.approx(float(raw[9]), abs=1e-4)
    assert masks.rows == [2] and constraints.num_tracked == 1
    constraints.forget(["m"])
    assert constraints.num_tracked == 0
