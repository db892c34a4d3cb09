"""Batched sampling on device, with per-request parameters mixed in one batch.

The runner builds a `SamplingBatch` from the step's rows once (`Sampler.prepare`, plain Python in,
arrays out), then calls `Sampler.sample(logits, batch)`; both run on the MLX thread and the result
comes back as Python ints after one evaluation (with the MLX ops, two in a step with a top_p row whose
nucleus may reach past its candidates, see below). Rows are split on the host by the work they need:

    logits (S, V) -> bitmask (grammars, allowed_token_ids), bans (min_tokens, bad words), logit_bias,
                     penalties: each only in steps that have it
      greedy rows      argmax                                          temperature 0
      full rows        x/T, min_p floor, inverse CDF over all V        no top_k, no top_p
      candidate rows   the K largest x; top_k, min_p, then top_p on    top_k or top_p
                       the renormalized survivors; inverse CDF over K
    tokens (S,) = concat(greedy, full, candidate)[inverse_order]

Order of processing as in vLLM: allowed tokens -> bans -> logit_bias -> penalties -> temperature ->
min_p and top_k -> top_p -> sample. Values tied with the k-th survive top_k. On the CPU with the kernels
built (backend "kernel"), the argmax, the full-vocabulary rows, the candidate rows and the logprobs' top-n
and normalizer are kernels.sampling's one-node kernels (the candidate rows by O(V) selection, no K and no
retry); metrale.sampling.ops' MLX ops are the reference backend. With those, a top_p row without top_k
starts from TOP_P_CANDIDATES candidates; a row whose nucleus is larger (rare) is re-run with 8x as many,
up to the whole vocabulary (checking costs one small host sync in steps that have such rows).

Randomness is ONE uniform number per sampled row, drawn on the host: a seeded row's uniform depends
only on (seed, output position), so its token never depends on the batch around it; unseeded rows
draw from the sampler's own generator. The token is the inverse CDF of the row's (unsorted)
distribution at that uniform: exact, with no (S, V) noise to generate.

Penalties: repetition_penalty over prompt + output tokens (HF/vLLM: positive logits divided,
negative multiplied); presence / frequency over output tokens (OpenAI: minus presence once, minus
frequency per occurrence). Logprobs are those of the RAW model distribution: log_softmax of the
logits before masks, bias, penalties, temperature and truncation (vLLM's "raw_logprobs").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kernels.sampling import argmax_fn, logsumexp_fn, sample_candidates_fn, sample_full_fn, top_ids_fn
from kernels.runtime import mx
from metrale.outputs import TokenLogprob
from metrale.sampling import ops
from metrale.sampling.batch import TOP_P_CANDIDATES, BatchBuilder, SamplingBatch, SamplingRowLike, seeded_bits
from metrale.sampling.logprobs import logprob_arrays, logprob_lists

__all__ = ["TOP_P_CANDIDATES", "Sampler", "SamplerOutput", "SamplingRowLike", "seeded_bits"]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One step's samples as Python values, in row order."""

    token_ids: list[int]  # (S,)
    logprobs: list[TokenLogprob | None]  # (S,); None where the row asked for no logprobs


class Sampler:
    """Samples one token per row from (S, V) logits. Lives on the MLX thread with the runner."""

    def __init__(self, vocab_size: int, *, eos_token_ids: Sequence[int] = (), seed: int | None = None,
                 backend: str | None = None) -> None:
        """`eos_token_ids` (with each row's stop_token_ids) are banned until the row has min_tokens
        output tokens, unless it ignores eos; `seed` seeds the unseeded rows' generator. `backend` ("kernel"
        | "reference", None: kernels.backend.activation_backend()) picks the argmax and the full-vocabulary sampling
        (kernels.sampling) or MLX's ops."""
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._builder = BatchBuilder(vocab_size, self.eos_token_ids, seed)
        self._argmax = argmax_fn(backend)  # (..., V) -> (...) uint32, as mx.argmax(x, axis=-1)
        self._sample_full = sample_full_fn(backend)  # None: the MLX ops of ops.sample_full
        self._sample_candidates = sample_candidates_fn(backend)  # None: ops.sample_candidates' MLX ops
        self._top_ids = top_ids_fn(backend)  # None: ops.largest's MLX ops
        self._logsumexp = logsumexp_fn(backend)  # (L, V) -> (L,), the raw logprobs' normalizer

    def prepare(self, rows: Sequence[SamplingRowLike], bitmask: np.ndarray | None = None) -> SamplingBatch:
        """Per-row Python params -> the step's arrays and host-side row groups (metrale.sampling.batch);
        `bitmask` (S, W) int32 holds each row's allowed tokens (metrale.sampling.constraints)."""
        return self._builder.build(rows, bitmask)

    def sample(self, logits: mx.array, batch: SamplingBatch) -> SamplerOutput:
        """logits (S, V) float32 -> one token per row (and logprobs where asked), as Python values."""
        if logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, the batch has {batch.num_rows}")
        if batch.is_plain_greedy:
            return SamplerOutput(self._argmax(logits).tolist(), [None] * batch.num_rows)
        x = logits  # (S, V), never modified in place: raw logprobs read `logits`
        if batch.bitmask is not None:
            x = ops.apply_bitmask(x, batch.bitmask)
        if batch.banned is not None:
            x = x.at[batch.banned[0], batch.banned[1]].add(-math.inf)
        if batch.logit_bias is not None:
            x = ops.apply_logit_bias(x, batch.logit_bias)
        if batch.penalties is not None:
            x = ops.apply_penalties(x, batch.penalties)
        parts = []
        if batch.num_greedy:
            parts.append(self._argmax(ops.select(x, batch.greedy_rows)).astype(mx.int32))  # (G,)
        if batch.full is not None:
            parts.append(ops.sample_full(x, batch.full, self._argmax, self._sample_full))  # (F,)
        if batch.candidates is not None:
            parts.append(ops.sample_candidates(x, batch.candidates, self.vocab_size, self._sample_candidates))  # (C,)
        tokens = mx.concatenate(parts) if len(parts) > 1 else parts[0]  # (S,) in group order
        if batch.inverse_order is not None:
            tokens = tokens[batch.inverse_order]  # (S,) in row order
        if not batch.logprob_rows:
            return SamplerOutput(tokens.tolist(), [None] * batch.num_rows)
        arrays = logprob_arrays(logits, tokens, batch, self._logsumexp, self._top_ids)
        mx.eval(tokens, *arrays)
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, logprob_lists(batch, token_ids, *arrays))

    def __call__(self, logits: mx.array, rows: Sequence[SamplingRowLike]) -> SamplerOutput:
        """`prepare` then `sample`."""
        return self.sample(logits, self.prepare(rows))
