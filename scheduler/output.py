"""The scheduler's step plan and its per-request events: frozen records of plain values."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import FinishReason, LoraRef


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step.

    Positions, for a chunk of 3 tokens starting at 5 with block_size 4:

        position     0 1 2 3 | 4 5 6 7 | 8 ...
        token_ids              a b c            start_position = 5, context = 8 tokens
        block_table  [  b0   ,   b1    ]        covers start_position + len(token_ids) tokens

    Attributes:
        request_id: the request.
        token_ids: the tokens whose KV is computed this step, in order.
        start_position: position of token_ids[0] (== tokens already computed before this step).
        block_table: the request's physical block ids, in token order.
        samples: the chunk reaches the end of the known tokens, so the runner samples one token
            from the logits of its last position.
        num_draft_tokens: draft tokens computed after token_ids (positions start_position +
            len(token_ids) ...), to be verified; the block table covers them too.
        draft_token_ids: those drafts, or () when the runner's proposer makes them.
        lora: the adapter whose low-rank updates the request's rows add, or None.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    samples: bool
    num_draft_tokens: int = 0
    draft_token_ids: tuple[int, ...] = ()
    lora: LoraRef | None = None

    @property
    def num_tokens(self) -> int:
        """Positions computed this step: the known tokens and the drafts."""
        return len(self.token_ids) + self.num_draft_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What one step computes; the runner's whole input.

    Attributes:
        scheduled: requests with tokens this step, running ones first, then newly admitted.
        num_batched_tokens: sum of num_tokens (known + draft) over `scheduled` (<= max_num_batched_tokens).
        preempted_request_ids: requests whose blocks were freed this step (to be recomputed).
        block_size: tokens per KV block (slot = block_table[pos // block_size] * block_size +
            pos % block_size).
        block_copies: (src block id, dst block id) pairs whose K/V the runner copies, once, before
            this step's forward: the partial blocks of requests forked since the last step.
    """

    scheduled: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted_request_ids: tuple[str, ...]
    block_size: int
    block_copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """New tokens and/or the end of one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens appended by this event (empty for a finish without a token).
        finish_reason: why it ended, or None while it runs.
        stop_token_id: the eos or stop token id that ended it, if one did.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None

    @property
    def finished(self) -> bool:
        """True when this is the request's last event."""
        return self.finish_reason is not None
