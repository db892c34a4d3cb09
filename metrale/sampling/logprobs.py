"""Log-probabilities of the RAW model distribution (log_softmax of the logits before penalties,
temperature and truncation; vLLM's default, "raw_logprobs"): the sampled token's and the top-n."""

from __future__ import annotations

from collections.abc import Callable

from kernels.runtime import mx
from kernels.sampling import TopIds, reference_logsumexp
from metrale.outputs import TokenLogprob
from metrale.sampling.batch import SamplingBatch, index_array, row_index
from metrale.sampling.ops import largest, select


def logprob_arrays(logits: mx.array, tokens: mx.array, batch: SamplingBatch,
                   logsumexp: Callable[[mx.array], mx.array] = reference_logsumexp,
                   top_ids: TopIds | None = None) -> tuple[mx.array, ...]:
    """Raw log_softmax at the sampled token, plus the top-n ids and logprobs, for logprob rows.
    `logsumexp`: (L, V) -> (L,), `top_ids`: (L, V), n -> (L, n) (the sampler passes kernels.sampling's)."""
    rows = index_array(batch.logprob_rows)
    raw = select(logits, row_index(list(batch.logprob_rows), batch.num_rows))  # (L, V)
    lse = logsumexp(raw)[:, None]  # (L, 1)
    sampled = mx.take_along_axis(raw, tokens[rows][:, None], axis=-1) - lse  # (L, 1)
    n = max(batch.num_logprobs)
    if n == 0:
        return (sampled,)
    values, ids = largest(raw, n, top_ids)  # (L, n)
    return sampled, ids, values - lse


def logprob_lists(batch: SamplingBatch, token_ids: list[int], sampled: mx.array,
                   ids: mx.array | None = None, top: mx.array | None = None) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = [None] * batch.num_rows
    sampled_list = sampled[:, 0].tolist()
    ids_list = ids.tolist() if ids is not None else None
    top_list = top.tolist() if top is not None else None
    for j, (row, n) in enumerate(zip(batch.logprob_rows, batch.num_logprobs)):
        alternatives = tuple(zip(ids_list[j][:n], top_list[j][:n])) if ids_list and top_list and n else ()
        out[row] = TokenLogprob(token_id=token_ids[row], logprob=sampled_list[j], top=alternatives)
    return out
