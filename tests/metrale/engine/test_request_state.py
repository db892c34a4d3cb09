"""RequestState: token ids -> deltas with text, stop strings and counts."""

from __future__ import annotations

from metrale.engine.request_state import RequestState
from metrale.sampling_params import SamplingParams
from metrale.text.processor import OutputProcessor
from tests.metrale.engine.fakes import EOS, FakeTokenizer
from scheduler import FinishReason


def state(params: SamplingParams) -> RequestState:
    return RequestState("r", params, 3, OutputProcessor(FakeTokenizer()).new_request([0, 1, 2], params))


def test_tokens_become_text_and_counts():
    s = state(SamplingParams(max_tokens=8))
    out = s.on_tokens((0, 1), None, hide_last_token=False, logprobs=None).output
    assert (out.token_ids, out.text, out.num_output_tokens, out.num_prompt_tokens) == ([0, 1], "ab", 2, 3)


def test_stop_token_counts_but_is_not_text():
    s = state(SamplingParams(max_tokens=8, skip_special_tokens=False))
    out = s.on_tokens((2, EOS), FinishReason.STOP, hide_last_token=True, logprobs=None).output
    assert out.text == "c" and out.num_output_tokens == 2 and out.finish_reason == "stop"


def test_stop_string_is_held_back_then_cut():
    s = state(SamplingParams(max_tokens=8, stop=["cd"]))
    first = s.on_tokens((0, 1, 2), None, hide_last_token=False, logprobs=None)
    assert first.output.text == "ab" and not first.stop_string_matched  # "c" may start "cd"
    second = s.on_tokens((3,), None, hide_last_token=False, logprobs=None)
    assert second.stop_string_matched and second.output.text == "" and second.output.finish_reason == "stop"


def test_error_releases_held_text_and_abort_drops_it():
    held = state(SamplingParams(max_tokens=8, stop=["cd"]))
    held.on_tokens((2,), None, hide_last_token=False, logprobs=None)
    assert held.final_output(FinishReason.ERROR).text == "c"
    dropped = state(SamplingParams(max_tokens=8, stop=["cd"]))
    dropped.on_tokens((2,), None, hide_last_token=False, logprobs=None)
    assert dropped.final_output(FinishReason.ABORT).text == ""
