"""The engine's per-request state on the event-loop side: its text, timings and channel.

The scheduler's `Request` owns token ids and KV progress; this owns everything that turns tokens into
what the consumer sees. Created at submit, dropped when the final delta is pushed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from metrale.engine.stream import OutputChannel
from metrale.outputs import RequestOutput, TokenLogprob
from metrale.sampling_params import SamplingParams
from metrale.text.processor import RequestText
from scheduler import FinishReason

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestTimes:
    """Monotonic timestamps of one request's lifecycle (None until it happens)."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass(slots=True)
class TextDelta:
    """What one step produced for one request, after detokenizing and stop-string matching."""

    output: RequestOutput
    stop_string_matched: bool


class RequestState:
    """Turns a request's new token ids into stream deltas through its RequestText."""

    __slots__ = ("request_id", "params", "channel", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens",
                 "times", "num_preemptions", "group", "_text", "_prompt_logprobs")

    def __init__(self, request_id: str, params: SamplingParams, num_prompt_tokens: int, text: RequestText) -> None:
        self.request_id = request_id
        self.params = params
        self.channel = OutputChannel(request_id)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served, known when first scheduled
        self.times = RequestTimes()
        self.num_preemptions = 0
        self.group: tuple[str, int] | None = None  # parallel sampling: (the group's first id, n); None for n = 1
        self._text = text
        # one per prompt position (None at 0), filled chunk by chunk; sent with the first delta, then None
        self._prompt_logprobs: list[TokenLogprob | None] | None = \
            [None] * num_prompt_tokens if params.prompt_logprobs is not None else None

    def record_prompt_logprobs(self, first_position: int, logprobs: list[TokenLogprob]) -> None:
        """Prompt logprobs of positions first_position.. (a recomputed chunk writes the same positions)."""
        if self._prompt_logprobs is not None:
            self._prompt_logprobs[first_position:first_position + len(logprobs)] = logprobs

    def on_tokens(self, token_ids: tuple[int, ...], finish_reason: FinishReason | None,
                  hide_last_token: bool, logprobs: list[TokenLogprob] | None) -> TextDelta:
        """Detokenize new ids (the stop token id, if any, is counted but never becomes text).

        Several ids at once (an accepted speculative run) with stop strings are matched one id at a time,
        and the ids after the one that completes a stop string are dropped: token_ids, usage and text
        are those of plain decoding, which would have stopped there."""
        text_ids = token_ids[:-1] if hide_last_token else token_ids
        if len(text_ids) > 1 and self._text.has_stop_strings:
            text, matched, num_used = self._push_each(text_ids, final=finish_reason is not None)
            if matched:
                token_ids = token_ids[:num_used]
                logprobs = logprobs[:num_used] if logprobs is not None else None
        else:
            text, matched = self._text.push(text_ids, final=finish_reason is not None)
        self.num_output_tokens += len(token_ids)
        if matched:
            finish_reason = FinishReason.STOP
        output = RequestOutput(request_id=self.request_id, token_ids=list(token_ids), text=text,
                               finish_reason=finish_reason, num_prompt_tokens=self.num_prompt_tokens,
                               num_output_tokens=self.num_output_tokens, logprobs=logprobs,
                               num_cached_tokens=self.num_cached_tokens, prompt_logprobs=self._prompt_logprobs)
        self._prompt_logprobs = None  # the prompt is computed once a token is sampled: sent once, here
        return TextDelta(output, matched)

    def _push_each(self, text_ids: tuple[int, ...], final: bool) -> tuple[str, bool, int]:
        """(text, stop string matched, ids used): the ids pushed one by one until a stop string matches."""
        pieces = []
        for index, token_id in enumerate(text_ids):
            last = index == len(text_ids) - 1
            text, matched = self._text.push((token_id,), final=final and last)
            pieces.append(text)
            if matched:
                return "".join(pieces), True, index + 1
        return "".join(pieces), False, len(text_ids)

    def final_output(self, finish_reason: FinishReason) -> RequestOutput:
        """The last delta of a request ended outside a step's tokens (abort, error). Never raises: if
        the held-back text cannot be produced, the delta goes without it (the token ids are complete)."""
        text = ""
        if finish_reason is not FinishReason.ABORT:  # an abort drops held-back text; an error delivers it
            try:
                text = self._text.flush()
            except Exception:
                logger.exception("request %s: held-back text lost while ending it", self.request_id)
        return RequestOutput(request_id=self.request_id, token_ids=[], text=text,
                             finish_reason=finish_reason, num_prompt_tokens=self.num_prompt_tokens,
                             num_output_tokens=self.num_output_tokens, num_cached_tokens=self.num_cached_tokens)
