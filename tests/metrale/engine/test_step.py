"""The step's records cross a process boundary as they are: msgpack round trips of RowResult and
ForwardInput, and a row's error comes back as the error the stream raises."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from metrale.engine.step import (ForwardInput, PromptLogprobs, RowError, RowFailedError, RowResult, decode_rows,
                                 encode_rows)
from metrale.failpoints import InjectedFault
from metrale.outputs import TokenLogprob

ROWS = [
    RowResult("plain", (7,)),
    RowResult("verified", (60, 61, 9)),
    RowResult("with-logprobs", (3,), TokenLogprob(3, -0.25, ((3, -0.25), (8, -1.5))),
              PromptLogprobs(1, [TokenLogprob(5, -2.0, (), 4), TokenLogprob(6, -0.5, (), 1)])),
    RowResult("grammar-done", (2,), stopped=True),
    RowResult("prompt-chunk", prompt_logprobs=PromptLogprobs(1, [TokenLogprob(9, -3.0, (), 12)])),
    RowResult("culprit", error=RowError.of(ValueError("bad row"), kv_unwritten=True)),
    RowResult("embedding", embedding=b"\x00\x00\x80?" * 4),  # four float32 1.0s
]


def test_rows_round_trip_through_msgpack():
    data = encode_rows(ROWS)
    assert decode_rows(data) == ROWS
    assert len(data) < 420  # array_like, defaults omitted: a decode row is a few bytes


def test_forward_input_round_trips_through_msgpack_and_pickle():
    forward = ForwardInput((1, 2, 3, 4), (3, 1), (3, 9), ((0,), (4, 5, 6)), 4, ((1, 2),))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(forward), type=ForwardInput) == forward
    assert pickle.loads(pickle.dumps(forward)) == forward  # the TP channel pickles it


def test_a_row_error_comes_back_as_an_error_that_names_the_original():
    error = RowError.of(ValueError("bad row"))
    rebuilt = decode_rows(encode_rows([RowResult("a", error=error)]))[0].error.exception("a")
    assert isinstance(rebuilt, RowFailedError) and rebuilt.kind == "ValueError" and str(rebuilt) == "bad row"


def test_a_failpoint_error_comes_back_as_the_injected_fault():
    error = RowError.of(InjectedFault("execute", "victim"), kv_unwritten=True)
    rebuilt = decode_rows(encode_rows([RowResult("victim", error=error)]))[0].error.exception("victim")
    assert isinstance(rebuilt, InjectedFault) and (rebuilt.point, rebuilt.request_id) == ("execute", "victim")


def test_a_malformed_record_is_refused():
    with pytest.raises(msgspec.ValidationError):
        decode_rows(msgspec.msgpack.encode([["a", "not tokens"]]))
