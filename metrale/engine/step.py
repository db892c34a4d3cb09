"""The step's records: what one forward computes (ForwardInput) and what one step gave each request
(RowResult). Both are msgspec Structs of plain values, so they cross a process boundary as they are:
rank 0 hands every ForwardInput to the other ranks of a tensor-parallel group (metrale.distributed),
and a RowResult is what an engine process reports per request per step.

A ForwardInput:

    token_ids     [a a a a a | b | c]    every scheduled token (drafts included), flat   (T,)
    query_lens    [5, 1, 1]              new tokens per sequence                          (S,)
    context_lens  [21, 41, 8]            cached prefix + new tokens per sequence          (S,)
    block_tables  ((..), (..), (..))     each sequence's pool blocks, in order            (S, *)
    block_copies  ((src, dst), ...)      forked requests' partial blocks, copied first in every pool

Every rank builds the same AttentionMetadata from a ForwardInput and runs the model over its own share of
the weights and its own kv heads' paged pools.

A RowResult holds one request's share of a step: its sampled tokens (one, or for a speculating request
the accepted drafts then the target's own token), the logprob of a sampled token, the prompt logprobs
of the chunk it computed, whether its constraint is complete (it ends with "stop"), its error, or for an
embedding request after its last prompt chunk its pooled vector (metrale.engine.pooling). Only
requests with something to report have one: a prompt chunk that samples nothing and asked for no prompt
logprobs gets none.
"""

from __future__ import annotations

import msgspec

from kernels.runtime import mx, nn
from kvcache.attention import AttentionMetadata
from kvcache.storage import PagedKVCache
from metrale.failpoints import InjectedFault
from metrale.outputs import FinishReason, TokenLogprob

__all__ = ["EngineOutput", "ForwardInput", "PromptLogprobs", "RowError", "RowFailedError", "RowResult", "decode_rows",
           "encode_rows"]


class ForwardInput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The plain-Python input of one forward (see the module docstring)."""

    token_ids: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    block_size: int
    block_copies: tuple[tuple[int, int], ...] = ()

    def run(self, model: nn.Module, kv_cache: PagedKVCache, backend: str | None) -> mx.array:
        """The model's final hidden states (T, D), lazy; this step's block copies, then its K/V, are
        written to `kv_cache`."""
        if self.block_copies:
            kv_cache.copy_blocks(self.block_copies)
        metadata = AttentionMetadata.build(self.query_lens, self.context_lens, self.block_tables, self.block_size,
                                           backend=backend)
        return model(mx.array(self.token_ids, dtype=mx.int32), metadata.positions, kv_cache, metadata)  # (T, D)


class RowFailedError(RuntimeError):
    """A request's step failed in the engine; `kind` names the original exception's type."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class RowError(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """Why a request failed in a step, as plain values.

    kind, message: the exception's type name and text. point: the failpoint that fired, if one did.
    kv_unwritten: the forward failed for this request (a culprit of a bisected step), so the KV of the
    blocks it was computing may be unwritten: their prefix-cache hashes are discarded when it ends.
    """

    kind: str
    message: str
    point: str | None = None
    kv_unwritten: bool = False

    @classmethod
    def of(cls, error: BaseException, *, kv_unwritten: bool = False) -> RowError:
        point = error.point if isinstance(error, InjectedFault) else None
        return cls(type(error).__name__, str(error), point, kv_unwritten)

    def exception(self, request_id: str) -> BaseException:
        """The error to deliver to the request's stream (a failpoint's InjectedFault is rebuilt as one)."""
        if self.point is not None:
            return InjectedFault(self.point, request_id)
        return RowFailedError(self.kind, self.message)


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The logprobs of prompt tokens first_position.. computed this step (one per scored position)."""

    first_position: int
    logprobs: list[TokenLogprob]


class RowResult(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """One request's share of one step (see the module docstring)."""

    request_id: str
    token_ids: tuple[int, ...] = ()  # () when it sampled nothing (a prompt chunk, an error)
    logprob: TokenLogprob | None = None  # of the sampled token, when the request asked for logprobs
    prompt_logprobs: PromptLogprobs | None = None
    stopped: bool = False  # its constraint is complete: it ends with "stop" after this token
    error: RowError | None = None
    embedding: bytes | None = None  # an embedding request's pooled vector after its last chunk (float32, LE)


class EngineOutput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """What the engine core reports for one request after a step (or when it ends outside one): its new
    token ids and, on its last output, why it ended. The text front-end (detokenizer, stop strings,
    streams) turns it into the RequestOutput its consumer reads; it is the record an engine process
    sends its front-end.

    hide_last_token: the last token is the eos or stop token id that ended it (counted, never text).
    prompt_logprobs: on its first output with tokens, when it asked (one per prompt position, None at 0).
    error: why it failed (finish_reason "error"); an abort has none.
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    hide_last_token: bool = False
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    error: RowError | None = None
    embedding: bytes | None = None  # an embedding request's pooled vector, on its final output (float32, LE)


_ENCODER = msgspec.msgpack.Encoder()
_ROWS_DECODER = msgspec.msgpack.Decoder(list[RowResult])


def encode_rows(rows: list[RowResult]) -> bytes:
    """A step's records as msgpack bytes."""
    return _ENCODER.encode(rows)


def decode_rows(data: bytes) -> list[RowResult]:
    return _ROWS_DECODER.decode(data)
