"""The engine core's per-request state beside the scheduler's Request: params, timings, counts.

The scheduler's `Request` owns token ids and KV progress; this owns what the core reports for the
request (metrale.engine.step.EngineOutput) and its timings for the metrics. Its text, stop strings and
stream live in the front-end (metrale.engine.streams). Created at submit, dropped when it ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from metrale.engine.step import EngineOutput, RowError
from metrale.outputs import TokenLogprob
from metrale.pooling_params import PoolingParams
from metrale.sampling_params import SamplingParams
from scheduler import FinishReason


@dataclass(slots=True)
class RequestTimes:
    """Monotonic timestamps of one request's lifecycle (None until it happens)."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class RequestState:
    """One request's counts, timings and prompt logprobs, turned into EngineOutputs."""

    __slots__ = ("request_id", "params", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "times",
                 "num_preemptions", "group", "pooling", "max_tokens", "_prompt_logprobs")

    def __init__(self, request_id: str, params: SamplingParams, num_prompt_tokens: int,
                 pooling: PoolingParams | None = None, max_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.params = params
        self.max_tokens = max_tokens  # the effective limit (params.max_tokens, or what the engine chose)
        self.pooling = pooling  # an embedding request: pooled after its prompt, never sampled
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served, known when first scheduled
        self.times = RequestTimes()
        self.num_preemptions = 0
        self.group: tuple[str, int] | None = None  # parallel sampling: (the group's first id, n); None for n = 1
        # one per prompt position (None at 0), filled chunk by chunk; sent with the first tokens, then None
        self._prompt_logprobs: list[TokenLogprob | None] | None = \
            [None] * num_prompt_tokens if params.prompt_logprobs is not None else None

    def record_prompt_logprobs(self, first_position: int, logprobs: list[TokenLogprob]) -> None:
        """Prompt logprobs of positions first_position.. (a recomputed chunk writes the same positions)."""
        if self._prompt_logprobs is not None:
            self._prompt_logprobs[first_position:first_position + len(logprobs)] = logprobs

    def on_tokens(self, token_ids: tuple[int, ...], finish_reason: FinishReason | None, hide_last_token: bool,
                  logprobs: list[TokenLogprob] | None) -> EngineOutput:
        """The output of new token ids (the stop token id, if any, is counted but never becomes text)."""
        self.num_output_tokens += len(token_ids)
        output = EngineOutput(self.request_id, token_ids, finish_reason, hide_last_token, logprobs,
                              self._prompt_logprobs, self.num_cached_tokens)
        self._prompt_logprobs = None  # the prompt is computed once a token is sampled: sent once, here
        return output

    def pooled_output(self, embedding: bytes) -> EngineOutput:
        """The last output of an embedding request: its vector, finish_reason "stop"."""
        return EngineOutput(self.request_id, (), FinishReason.STOP, num_cached_tokens=self.num_cached_tokens,
                            embedding=embedding)

    def final_output(self, finish_reason: FinishReason, error: BaseException | None = None) -> EngineOutput:
        """The last output of a request ended outside a step's tokens (abort, error)."""
        return EngineOutput(self.request_id, (), finish_reason, num_cached_tokens=self.num_cached_tokens,
                            error=RowError.of(error) if error is not None else None)
