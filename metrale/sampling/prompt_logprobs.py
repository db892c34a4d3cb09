"""Prompt logprobs (vLLM's `prompt_logprobs`, and what OpenAI's echo + logprobs returns): the log
probability of each prompt token given the tokens before it, from the RAW model distribution.

Only the requests that ask get extra rows through the lm_head; for them the logits of every
prompt position whose next token is also in the prompt are computed, chunk by chunk:

    prompt      t0  t1  t2  t3 | t4  t5        chunk of this step: positions 3..5 (P = 6)
    scored row      p0  p1  p2 | p3  p4        row at position p scores t(p + 1); p5 samples instead
    this step's rows: positions 3 and 4 -> TokenLogprobs of t4 and t5, first position 4

Each row costs a (V,) float32 vector: a chunk of C tokens holds C x V floats while it is scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kernels.runtime import mx
from metrale.outputs import TokenLogprob
from metrale.sampling.ops import largest


@dataclass(frozen=True, slots=True)
class _Span:
    request_id: str
    first_position: int  # the position of the first token scored
    count: int  # rows
    num_logprobs: int  # top alternatives


@dataclass(frozen=True, slots=True)
class PromptRows:
    """The flat batch rows whose logits score prompt tokens this step, and what they score."""

    rows: list[int]  # (R,) rows of the step's flat batch
    targets: list[int]  # (R,) the prompt token each row scores
    spans: list[_Span]

    @classmethod
    def plan(cls, scheduled: Sequence, wanted: Sequence) -> "PromptRows":
        """`scheduled`: the step's ScheduledRequests in batch order; `wanted`: PromptLogprobsRow of the
        requests that asked."""
        by_id = {w.request_id: w for w in wanted}
        rows: list[int] = []
        targets: list[int] = []
        spans: list[_Span] = []
        start_row = 0
        for s in scheduled:
            want = by_id.get(s.request_id)
            if want is not None:
                prompt = want.prompt_token_ids
                end = min(s.start_position + s.num_tokens, len(prompt) - 1)  # positions [start, end) score
                if end > s.start_position:
                    rows.extend(range(start_row, start_row + end - s.start_position))
                    targets.extend(prompt[s.start_position + 1:end + 1])
                    spans.append(_Span(s.request_id, s.start_position + 1, end - s.start_position, want.num_logprobs))
            start_row += s.num_tokens
        return cls(rows, targets, spans)

    def logprobs(self, logits: mx.array) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """logits (R, V) float32 of `rows` -> per request (first position, its TokenLogprobs)."""
        top = logits.max(axis=-1, keepdims=True)  # (R, 1)
        lse = top + mx.log(mx.exp(logits - top).sum(axis=-1, keepdims=True))  # (R, 1)
        target_logits = mx.take_along_axis(logits, mx.array(self.targets, dtype=mx.int32)[:, None], axis=-1)  # (R, 1)
        ranks = (logits > target_logits).sum(axis=-1) + 1  # (R,)
        values = (target_logits - lse)[:, 0]  # (R,)
        k = max(span.num_logprobs for span in self.spans)
        alt_ids = alt_values = None
        if k:
            alt_logits, alt_ids = largest(logits, k)  # (R, k)
            alt_values = alt_logits - lse
        mx.eval(values, ranks, *(a for a in (alt_ids, alt_values) if a is not None))
        value_list, rank_list = values.tolist(), ranks.tolist()
        id_list = alt_ids.tolist() if alt_ids is not None else None
        alt_list = alt_values.tolist() if alt_values is not None else None
        out: dict[str, tuple[int, list[TokenLogprob]]] = {}
        row = 0
        for span in self.spans:
            items = []
            for j in range(row, row + span.count):
                top_n = tuple(zip(id_list[j][:span.num_logprobs], alt_list[j][:span.num_logprobs])) \
                    if span.num_logprobs else ()
                items.append(TokenLogprob(self.targets[j], value_list[j], top_n, rank_list[j]))
            out[span.request_id] = (span.first_position, items)
            row += span.count
        return out
