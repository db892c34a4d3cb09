"""RequestState: the core's per-request counts and prompt logprobs, turned into EngineOutputs."""

from __future__ import annotations

from metrale.engine.request_state import RequestState
from metrale.outputs import TokenLogprob
from metrale.sampling_params import SamplingParams
from scheduler import FinishReason


def test_tokens_are_counted_and_prompt_logprobs_sent_once():
    state = RequestState("r", SamplingParams(max_tokens=8, prompt_logprobs=0), 3)
    state.record_prompt_logprobs(1, [TokenLogprob(5, -1.0), TokenLogprob(6, -2.0)])
    first = state.on_tokens((7,), None, False, None)
    assert first.token_ids == (7,) and first.prompt_logprobs == [None, TokenLogprob(5, -1.0), TokenLogprob(6, -2.0)]
    second = state.on_tokens((8, 2), FinishReason.STOP, True, None)
    assert second.prompt_logprobs is None and second.hide_last_token and state.num_output_tokens == 3


def test_a_final_output_carries_its_error_as_values():
    state = RequestState("r", SamplingParams(max_tokens=8), 3)
    out = state.final_output(FinishReason.ERROR, ValueError("broken"))
    assert (out.finish_reason, out.error.kind, out.error.message) == ("error", "ValueError", "broken")
    assert state.final_output(FinishReason.ABORT).error is None
