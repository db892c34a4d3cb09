"""Who speculates this step, and with how many drafts.

A request speculates when its verification is exact with a plain argmax (greedy, no penalties, no
logprobs, no min_tokens ban still in force, no token masks or structured output), when fewer than `disable_by_batch_size` requests run
(a full batch already uses the step well; drafts would only add work), and when it has room left
(k <= max_tokens - output - 1). Its draft count follows its recent acceptance: an exponential
average of accepted / proposed scales num_speculative_tokens; a request whose drafts keep failing
stops speculating and tries one draft again every PROBE_EVERY steps.
"""

from __future__ import annotations

import math

from metrale.sampling_params import SamplingParams
from metrale.speculative.config import SpeculativeConfig

PROBE_EVERY = 8
SMOOTHING = 0.3  # weight of the newest acceptance ratio in the average
GIVE_UP_BELOW = 0.15


def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """The target's choice is a plain argmax at every draft position."""
    return (params.is_greedy and not params.has_penalties and params.logprobs is None
            and num_output_tokens >= params.min_tokens and not params.has_token_masks
            and params.structured_outputs is None)


class SpeculationPolicy:
    """Per-request draft counts from acceptance history; forgets requests when they end."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._acceptance: dict[str, float] = {}  # request id -> recent accepted / proposed
        self._idle_steps: dict[str, int] = {}

    def num_drafts(self, request_id: str, params: SamplingParams, num_output_tokens: int, max_tokens: int,
                   num_running: int) -> int:
        """How many drafts this request gets this step (0: it does not speculate)."""
        room = max_tokens - num_output_tokens - 1
        if room < 1 or num_running > self.config.disable_by_batch_size or not can_speculate(params, num_output_tokens):
            return 0
        k = self.config.num_speculative_tokens
        if self.config.adaptive:
            rate = self._acceptance.get(request_id, 1.0)
            if rate < GIVE_UP_BELOW:
                idle = self._idle_steps.get(request_id, 0) + 1
                self._idle_steps[request_id] = idle
                k = 1 if idle % PROBE_EVERY == 0 else 0
            else:
                k = max(1, math.ceil(k * rate))
        return min(k, room)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification happened: `num_accepted` of `num_drafts` drafts were right."""
        if num_drafts:
            previous = self._acceptance.get(request_id, 1.0)
            self._acceptance[request_id] = (1 - SMOOTHING) * previous + SMOOTHING * num_accepted / num_drafts

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self._idle_steps.pop(request_id, None)
