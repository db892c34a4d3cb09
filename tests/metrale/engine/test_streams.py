"""RequestStreams: the core's EngineOutputs -> stream deltas with text, stop strings and counts; a stop
string or a failing delivery ends the request here and tells the core."""

from __future__ import annotations

from metrale.engine.step import EngineOutput
from metrale.engine.streams import RequestStreams
from metrale.failpoints import Failpoints
from metrale.sampling_params import SamplingParams
from metrale.text.processor import OutputProcessor
from scheduler import FinishReason
from tests.metrale.engine.fakes import EOS, FakeTokenizer


def streams(params: SamplingParams, failpoints: str = ""):
    told = []
    points = Failpoints.from_spec(failpoints, seed=0)
    front = RequestStreams(lambda rid, reason, error: told.append((rid, reason, error)), points)
    (channel,) = front.open(["r"], [OutputProcessor(FakeTokenizer()).new_request([0, 1, 2], params)], 3)
    return front, channel, told


def test_tokens_become_text_and_counts():
    front, channel, told = streams(SamplingParams(max_tokens=8))
    front.process([EngineOutput("r", (0, 1))])
    out = channel.take()
    assert (out.token_ids, out.text, out.num_output_tokens, out.num_prompt_tokens) == ([0, 1], "ab", 2, 3)
    assert told == [] and "r" in front


def test_stop_token_counts_but_is_not_text():
    front, channel, told = streams(SamplingParams(max_tokens=8, skip_special_tokens=False))
    front.process([EngineOutput("r", (2, EOS), FinishReason.STOP, hide_last_token=True)])
    out = channel.take()
    assert out.text == "c" and out.num_output_tokens == 2 and out.finish_reason == "stop"
    assert told == [] and "r" not in front  # the core ended it itself


def test_a_stop_string_is_held_back_then_cut_and_ends_the_request_in_the_core():
    front, channel, told = streams(SamplingParams(max_tokens=8, stop=["cd"]))
    front.process([EngineOutput("r", (0, 1, 2))])
    assert channel.take().text == "ab"  # "c" may start "cd"
    front.process([EngineOutput("r", (3,))])
    out = channel.take()
    assert out.text == "" and out.finish_reason == "stop"
    assert told == [("r", FinishReason.STOP, None)]
    front.process([EngineOutput("r", (4,))])  # a step the core ran before it heard: dropped
    assert channel.take() is None


def test_error_releases_held_text_and_abort_drops_it():
    front, channel, _ = streams(SamplingParams(max_tokens=8, stop=["cd"]))
    front.process([EngineOutput("r", (2,)), EngineOutput("r", (), FinishReason.ERROR)])
    assert channel.take().text == "c"
    front, channel, _ = streams(SamplingParams(max_tokens=8, stop=["cd"]))
    front.process([EngineOutput("r", (2,)), EngineOutput("r", (), FinishReason.ABORT)])
    assert channel.take().text == ""


def test_a_failing_delivery_ends_that_request_with_an_error_and_tells_the_core():
    front, channel, told = streams(SamplingParams(max_tokens=8), failpoints="deliver=@r")
    front.process([EngineOutput("r", (0,))])
    out = channel.take()
    assert out.finish_reason == "error" and channel.error is not None
    assert [(rid, reason, error.point) for rid, reason, error in told] == [("r", FinishReason.ERROR, "deliver")]
