"""RequestStreams: the text front-end's side of every open request (event-loop thread).

The engine core reports EngineOutputs (token ids, finish reasons, errors); this turns each into the
RequestOutput its stream's consumer reads: detokenize, match stop strings, put it on the request's
OutputChannel. A stop string ends the request here, so the core is told to finish it (`finish`);
so is a request whose own output processing raises (it alone ends, with an error). The core may
report more tokens of a request this side has already ended (an engine process runs a step before it
hears of a stop string): outputs of requests no longer open are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from metrale.engine.step import EngineOutput, RowError
from metrale.engine.stream import OutputChannel
from metrale.failpoints import NO_FAILPOINTS, Failpoints
from metrale.outputs import RequestOutput
from metrale.text.processor import RequestText
from scheduler import FinishReason

logger = logging.getLogger(__name__)

# (request id, reason, error): tell the engine core to end a request the front-end ended
FinishCore = Callable[[str, FinishReason, RowError | None], None]


class _OpenRequest:
    __slots__ = ("channel", "text", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens")

    def __init__(self, channel: OutputChannel, text: RequestText, num_prompt_tokens: int) -> None:
        self.channel = channel
        self.text = text
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self.num_cached_tokens = 0


class RequestStreams:
    """Every open request's text state and channel; `process` delivers the core's outputs."""

    def __init__(self, finish_core: FinishCore, failpoints: Failpoints = NO_FAILPOINTS) -> None:
        self._finish_core = finish_core
        self._failpoints = failpoints
        self._open: dict[str, _OpenRequest] = {}

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def open(self, request_ids: Sequence[str], texts: Sequence[RequestText], num_prompt_tokens: int) -> list[OutputChannel]:
        """Register submitted requests; their channels, in order."""
        channels = []
        for request_id, text in zip(request_ids, texts):
            channel = OutputChannel(request_id)
            self._open[request_id] = _OpenRequest(channel, text, num_prompt_tokens)
            channels.append(channel)
        return channels

    def channel(self, request_id: str) -> OutputChannel | None:
        entry = self._open.get(request_id)
        return entry.channel if entry is not None else None

    def process(self, outputs: Sequence[EngineOutput]) -> None:
        """Deliver one batch of the core's outputs (never raises for one request's sake)."""
        for output in outputs:
            entry = self._open.get(output.request_id)
            if entry is None:
                continue
            try:
                self._deliver(output.request_id, entry, output)
            except Exception as error:  # this request's own output processing failed: it alone ends
                logger.exception("request %s failed while processing its output", output.request_id)
                self._end(output.request_id, entry, FinishReason.ERROR, error)
                self._finish_core(output.request_id, FinishReason.ERROR, RowError.of(error))

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with an error now (the engine is gone)."""
        for request_id, entry in list(self._open.items()):
            self._end(request_id, entry, FinishReason.ERROR, error)

    def _deliver(self, request_id: str, entry: _OpenRequest, output: EngineOutput) -> None:
        entry.num_cached_tokens = output.num_cached_tokens or entry.num_cached_tokens
        finish_reason = output.finish_reason
        if finish_reason in (FinishReason.ABORT, FinishReason.ERROR) and not output.token_ids:
            error = output.error.exception(request_id) if output.error is not None else None
            self._end(request_id, entry, finish_reason, error)
            return
        token_ids, logprobs = output.token_ids, output.logprobs
        text_ids = token_ids[:-1] if output.hide_last_token else token_ids
        if len(text_ids) > 1 and entry.text.has_stop_strings:  # an accepted speculative run
            text, matched, num_used = _push_each(entry.text, text_ids, final=finish_reason is not None)
            if matched:  # the ids after the stop string's are dropped: plain decoding would have stopped there
                token_ids = token_ids[:num_used]
                logprobs = logprobs[:num_used] if logprobs is not None else None
        else:
            text, matched = entry.text.push(text_ids, final=finish_reason is not None)
        entry.num_output_tokens += len(token_ids)
        if matched:
            finish_reason = FinishReason.STOP
        delta = RequestOutput(request_id=request_id, token_ids=list(token_ids), text=text,
                              finish_reason=finish_reason, num_prompt_tokens=entry.num_prompt_tokens,
                              num_output_tokens=entry.num_output_tokens, logprobs=logprobs,
                              num_cached_tokens=entry.num_cached_tokens, prompt_logprobs=output.prompt_logprobs,
                              embedding=output.embedding)
        self._failpoints.check("deliver", request_id)
        entry.channel.put(delta)
        if finish_reason is not None:
            del self._open[request_id]
            if output.finish_reason is None:  # a stop string: the core has not ended it
                self._finish_core(request_id, FinishReason.STOP, None)

    def _end(self, request_id: str, entry: _OpenRequest, finish_reason: FinishReason,
             error: BaseException | None) -> None:
        """The last delta of a request ended outside its tokens (abort, error). Never raises: if the
        held-back text cannot be produced, the delta goes without it (the token ids are complete)."""
        self._open.pop(request_id, None)
        text = ""
        if finish_reason is not FinishReason.ABORT:  # an abort drops held-back text; an error delivers it
            try:
                text = entry.text.flush()
            except Exception:
                logger.exception("request %s: held-back text lost while ending it", request_id)
        entry.channel.put(RequestOutput(request_id=request_id, token_ids=[], text=text, finish_reason=finish_reason,
                                        num_prompt_tokens=entry.num_prompt_tokens,
                                        num_output_tokens=entry.num_output_tokens,
                                        num_cached_tokens=entry.num_cached_tokens), error=error)


def _push_each(text: RequestText, text_ids: tuple[int, ...], final: bool) -> tuple[str, bool, int]:
    """(text, stop string matched, ids used): the ids pushed one by one until a stop string matches."""
    pieces = []
    for index, token_id in enumerate(text_ids):
        piece, matched = text.push((token_id,), final=final and index == len(text_ids) - 1)
        pieces.append(piece)
        if matched:
            return "".join(pieces), True, index + 1
    return "".join(pieces), False, len(text_ids)
