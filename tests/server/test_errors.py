"""The server's error mapping (metrale/server/errors.py): statuses by type, `param` from the error's field."""

from __future__ import annotations

import pytest

from metrale.errors import (EmptyPromptError, EngineDeadError, EngineDrainingError, InvalidMessagesError,
                            InvalidParamsError, PromptTooLongError, QueueFullError, RequestFailedError,
                            RequestRejectedError)
from metrale.sampling_params import SamplingParams
from metrale.server.errors import from_engine_error, status_of
from metrale.server.protocol import CHAT_FIELDS
from metrale.server.responses_protocol import ENGINE_FIELDS


@pytest.mark.parametrize(("error", "status"), [
    (QueueFullError("full"), 429), (PromptTooLongError("long"), 400), (EmptyPromptError("empty"), 400),
    (RequestRejectedError("no"), 400), (EngineDrainingError("draining"), 503), (EngineDeadError("dead"), 503),
    (RequestFailedError("r", "boom"), None), (KeyError("x"), None),
])
def test_each_engine_error_type_has_its_status(error, status):
    assert status_of(error) == status


def test_a_parameter_error_names_its_field_not_a_word_of_its_message():
    with pytest.raises(InvalidParamsError) as raised:
        SamplingParams(top_p=0.0)
    assert raised.value.field == "top_p"
    error = InvalidParamsError("temperature must be lower than max_tokens", field="min_p")  # a misleading message
    assert from_engine_error(error).param == "min_p"


@pytest.mark.parametrize(("error", "renames", "param"), [
    (PromptTooLongError("prompt too long"), None, "prompt"),
    (PromptTooLongError("prompt too long"), CHAT_FIELDS, "messages"),
    (PromptTooLongError("prompt too long"), ENGINE_FIELDS, "input"),
    (InvalidParamsError("max_tokens must be >= 1", field="max_tokens"), ENGINE_FIELDS, "max_output_tokens"),
    (InvalidMessagesError("messages[0].role must be ..."), CHAT_FIELDS, "messages"),
    (QueueFullError("queue is full"), None, None),
    (ValueError("something else"), None, None),
])
def test_param_is_the_errors_field_as_the_endpoint_calls_it(error, renames, param):
    api_error = from_engine_error(error, renames)
    assert api_error.param == param and api_error.status == (status_of(error) or 400)
