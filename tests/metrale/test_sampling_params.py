"""SamplingParams: defaults, normalization, and every invalid value rejected with its field named."""

from __future__ import annotations

import json
import math
import re

import msgspec
import pytest

from metrale.sampling_params import SamplingParams
from metrale.structured_outputs import StructuredOutputs

INVALID = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", "16"),
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "hot"), ("temperature", False),
    ("top_k", -2), ("top_k", 2.0), ("top_k", None),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.0001), ("top_p", math.nan),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", math.inf),
    ("seed", 1.0), ("seed", "42"), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", True),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5), ("stop", {"a": 1}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", 7), ("stop_token_ids", [True]),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 0.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", 1e308), ("repetition_penalty", 1e-300),
    ("presence_penalty", -2.5), ("presence_penalty", 2.5), ("presence_penalty", math.nan),
    ("frequency_penalty", -2.01), ("frequency_penalty", 3), ("frequency_penalty", None),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0), ("logprobs", True),
    ("include_stop_str_in_output", 0), ("include_stop_str_in_output", None),
    ("skip_special_tokens", "false"),
    ("logit_bias", {5: 100.5}), ("logit_bias", {5: -101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: math.nan}), ("logit_bias", [5]),
    ("allowed_token_ids", []), ("allowed_token_ids", [-3]), ("allowed_token_ids", [1.0]), ("allowed_token_ids", 3),
    ("bad_words", [""]), ("bad_words", 3), ("bad_words", ["ok", None]),
    ("bad_words_token_ids", [[]]), ("bad_words_token_ids", [[-1]]), ("bad_words_token_ids", 5),
    ("structured_outputs", {}), ("structured_outputs", {"regex": "a", "choice": ["b"]}),
    ("structured_outputs", {"json": "{not json"}), ("structured_outputs", {"json": [1, 2]}),
    ("structured_outputs", {"choice": []}), ("structured_outputs", {"choice": ["a", ""]}),
    ("structured_outputs", {"regex": ""}), ("structured_outputs", {"grammar": "  "}),
    ("structured_outputs", {"json_object": "yes"}), ("structured_outputs", {"jsn": {}}), ("structured_outputs", 5),
    ("n", 0), ("n", 1.5), ("prompt_logprobs", -1), ("prompt_logprobs", 21),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_is_rejected_naming_its_field(field, value):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    message = str(error.value)
    assert message.startswith(field), message
    assert " must " in message and "got" in message, message


def test_every_field_has_an_invalid_case():
    assert {f for f, _ in INVALID} == set(SamplingParams.__struct_fields__)


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("temperature", 3.0, "[0, 2]"), ("top_p", 0.0, "(0, 1]"), ("min_p", 2.0, "[0, 1]"),
    ("presence_penalty", 9.0, "[-2, 2]"), ("logprobs", 99, "[0, 20]"), ("max_tokens", 0, ">= 1"),
    ("repetition_penalty", 0.0, "in [0.01, 100]"), ("top_k", -5, "0 / -1"),
])
def test_message_states_the_allowed_range(field, value, allowed):
    with pytest.raises(ValueError, match=re.escape(allowed)):
        SamplingParams(**{field: value})


def test_defaults_are_valid_and_documented_values():
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.min_p) == (16, 1.0, 0, 1.0, 0.0)
    assert params.stop is None and params.stop_strings == () and params.stop_token_ids == ()
    assert params.logprobs is None and not params.is_greedy and not params.has_penalties


def test_boundaries_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, top_k=-1, presence_penalty=-2.0,
                   frequency_penalty=2.0, logprobs=20, min_tokens=16, max_tokens=16, seed=-(2**63))
    SamplingParams(temperature=2, top_p=1e-9, min_p=0, top_k=1, logprobs=0, seed=2**64 - 1, repetition_penalty=0.01)


def test_stop_and_stop_token_ids_are_normalized_to_tuples():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=[]).stop is None
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_token_masks_are_normalized():
    params = SamplingParams(logit_bias={7: 100, 3: -100.0}, allowed_token_ids=[1, 2], bad_words="darn",
                            bad_words_token_ids=[[4, 5]])
    assert params.logit_bias == {7: 100.0, 3: -100.0} and params.allowed_token_ids == (1, 2)
    assert params.bad_words == ("darn",) and params.bad_words_token_ids == ((4, 5),)
    assert params.has_token_masks and not SamplingParams().has_token_masks
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams.from_dict(params.to_dict()) == params


def test_structured_outputs_from_a_dict_keep_the_schema_order():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    params = SamplingParams(structured_outputs={"json": schema})
    spec = params.structured_outputs
    assert isinstance(spec, StructuredOutputs) and spec.kind == "json"
    assert json.loads(spec.json) == schema and list(json.loads(spec.json)["properties"]) == ["b", "a"]
    assert spec.key == StructuredOutputs(json=json.dumps(schema)).key  # text or dict: one cache entry
    assert StructuredOutputs(json_object=True).key == ("json_object", None)
    assert StructuredOutputs(choice=["x", "y"]).choice == ("x", "y")
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert hash(StructuredOutputs(regex="a+")) == hash(StructuredOutputs(regex="a+"))


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties and SamplingParams(frequency_penalty=0.1).has_penalties


def test_frozen_and_hashable():
    params = SamplingParams(stop=["x"], stop_token_ids=[1])
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]
    assert hash(params) == hash(SamplingParams(stop=("x",), stop_token_ids=(1,)))


def test_from_dict_and_json_validate_and_name_the_field():
    params = SamplingParams.from_dict({"max_tokens": 8, "stop": ["</s>"], "seed": 3})
    assert params == SamplingParams(max_tokens=8, stop="</s>", seed=3)
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert SamplingParams.from_json(b'{"temperature": 0, "stop": "END"}') == SamplingParams(temperature=0, stop="END")
    for bad, field in [({"temperature": 7}, "temperature"), ({"top_k": "x"}, "top_k"),
                       ({"unknown_knob": 1}, "unknown_knob"), ({"min_tokens": 40}, "min_tokens")]:
        with pytest.raises(msgspec.ValidationError, match=field):
            SamplingParams.from_dict(bad)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams.from_json('{"logprobs": 50}')


@pytest.mark.parametrize(("name", "value", "words"), [
    ("stop", ["s"] * 129, "at most 128 strings, got 129"),  # 150,000 once slowed every stream
    ("stop", ["s" * 8193], "at most 8192 characters in all, got 8193"),
    ("stop", ["s" * 4096, "t" * 4097], "at most 8192 characters in all, got 8193"),
    ("bad_words", ["w"] * 129, "at most 128 strings, got 129"),  # 100,000 once stalled the event loop 3.8 s
    ("bad_words", ["w" * 8193], "at most 8192 characters in all, got 8193"),
    ("bad_words_token_ids", [[1]] * 65537, "at most 65536 token ids in all, got 65537 sequences"),
    ("bad_words_token_ids", [[1] * 40000, [2] * 40000], "at most 65536 token ids in all"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_client_sized_lists_are_bounded(name, value, words):
    with pytest.raises(ValueError, match=rf"^{name} must hold {re.escape(words)}"):
        SamplingParams(**{name: value})


def test_the_largest_stop_and_bad_word_lists_are_taken():
    from metrale.sampling_params import MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS

    params = SamplingParams(stop=["s" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS,
                            bad_words=["w" * (MAX_BAD_WORDS_CHARS // MAX_BAD_WORDS)] * MAX_BAD_WORDS)
    assert len(params.stop_strings) == MAX_STOP_STRINGS and len(params.bad_words) == MAX_BAD_WORDS
    with pytest.raises(ValueError, match=f"stop must hold at most {MAX_STOP_STRINGS} strings, got 150000"):
        SamplingParams(stop=["x"] * 150_000)


def test_token_id_collections_are_bounded_before_they_are_read():
    from metrale.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_TOKEN_IDS

    with pytest.raises(ValueError, match="logit_bias must hold at most"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})
    for name in ("allowed_token_ids", "stop_token_ids"):
        with pytest.raises(ValueError, match=f"{name} must hold at most"):
            SamplingParams(**{name: list(range(MAX_TOKEN_IDS + 1))})
    assert len(SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)}).logit_bias) == 1024
