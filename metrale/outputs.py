"""What the engine hands back: stream deltas, completed results, stats."""

from __future__ import annotations

import array
import enum
import sys
from collections.abc import Sequence

import msgspec

from scheduler.request import FinishReason

__all__ = ["CompletionResult", "EmbeddingOutput", "EngineInfo", "EngineState", "EngineStats", "FinishReason", "RequestOutput",
           "TokenLogprob", "Usage"]


class EngineState(enum.StrEnum):
    """What `health()` reports. A str: `state == "serving"` holds, and /health writes its value."""

    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"  # the engine died, or a step has been stuck far longer than usual
    RESTARTING = "restarting"  # the engine process died; a new one is starting
    STOPPED = "stopped"


class TokenLogprob(msgspec.Struct, frozen=True):
    """Log probability of one sampled token, with the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs carry it)


class RequestOutput(msgspec.Struct, kw_only=True):
    """One delta of a request's stream: what is new since the previous delta.

    Deltas a slow consumer did not pick up in time are merged, so `token_ids` may hold several
    tokens. `finish_reason` is set only on the last delta (a FinishReason, a str: "stop" | "length" | "abort" |
    "error").
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative, including this delta
    logprobs: list[TokenLogprob] | None = None
    index: int = 0  # which of the request's n output sequences (parallel sampling)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first delta; None for the first token
    stop_reason: str | int | None = None  # on the last delta: the stop string or stop token id that matched
    embedding: bytes | None = None  # an embedding request's pooled vector, on its last delta (float32, little-endian)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: "RequestOutput") -> None:
        """Fold a later delta into this one (the consumer has not read this one yet)."""
        self.token_ids.extend(later.token_ids)
        self.text += later.text
        self.finish_reason = later.finish_reason
        self.num_output_tokens = later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens
        self.stop_reason = later.stop_reason
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.embedding is not None:
            self.embedding = later.embedding


class EmbeddingOutput(msgspec.Struct, frozen=True):
    """One input's embedding: `data` holds its float32 values little-endian (what OpenAI's base64 encodes);
    `embedding` is them as Python floats."""

    request_id: str
    data: bytes
    num_prompt_tokens: int

    @property
    def embedding(self) -> list[float]:
        values = array.array("f", self.data)
        if sys.byteorder != "little":
            values.byteswap()
        return values.tolist()

    @property
    def dimensions(self) -> int:
        return len(self.data) // 4


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class CompletionResult(msgspec.Struct, frozen=True):
    """The whole result of a non-streaming request."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def from_outputs(cls, request_id: str, outputs: Sequence[RequestOutput]) -> "CompletionResult":
        """Join one request's stream deltas, in order (the last one carries finish_reason)."""
        token_ids = [t for out in outputs for t in out.token_ids]
        logprobs = [lp for out in outputs if out.logprobs for lp in out.logprobs]
        finish_reason = next((out.finish_reason for out in reversed(outputs) if out.finish_reason), FinishReason.ABORT)
        num_prompt_tokens = outputs[-1].num_prompt_tokens if outputs else 0
        return cls(request_id=request_id, text="".join(out.text for out in outputs), token_ids=token_ids,
                   finish_reason=finish_reason, usage=Usage(num_prompt_tokens, len(token_ids)),
                   logprobs=logprobs or None)


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot of the engine's state, cheap to take."""

    health: str
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_usage: float
    peak_kv_usage: float
    num_preemptions: int
    num_steps: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    requests_finished: int
    requests_unfinished: int = 0  # submitted and not yet ended (an abort lands at the next step boundary)

    def __getitem__(self, key: str):
        return getattr(self, key)


class EngineInfo(msgspec.Struct, frozen=True):
    """What a started engine loaded and how it holds it; fixed for the engine's life."""

    model_path: str  # the GGUF file or model folder that was loaded
    model_type: str  # the architecture family: "llama", "qwen3", "gemma3", ...
    dtype: str  # activations and float weights: "float32", "float16", "bfloat16"
    kv_block_size: int  # tokens per KV cache block
