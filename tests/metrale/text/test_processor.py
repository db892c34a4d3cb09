"""The text front-end: InputProcessor's checks and RequestText's deltas (the default model's tokenizer)."""

from __future__ import annotations

import pytest

from metrale.errors import EmptyPromptError, InvalidMessagesError, InvalidPromptError, InvalidTokenIdError, \
    PromptTooLongError
from metrale.failpoints import Failpoints, InjectedFault
from metrale.sampling_params import SamplingParams
from metrale.text.chat_template import ChatTemplate
from metrale.text.processor import InputProcessor, OutputProcessor
from tests.metrale.text_helpers import encode, load_tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def inputs(tokenizer, **kw) -> InputProcessor:
    return InputProcessor(tokenizer, ChatTemplate.for_tokenizer(tokenizer, "llama"), 49152, **kw)


def test_a_length_cut_inside_a_multibyte_character_shows_no_replacement_character(tokenizer):
    ids = encode(tokenizer, "ok 🙂🙂")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT))
    text = OutputProcessor(tokenizer).new_request([], SamplingParams()).push(ids[:cut], final=True)[0]
    assert REPLACEMENT not in text and text == tokenizer.decode(ids[:cut]).rstrip(REPLACEMENT)
    held = OutputProcessor(tokenizer).new_request([], SamplingParams())
    held.push(ids[:cut], final=False)
    assert REPLACEMENT not in held.flush()  # an error ends it: the same rule


def test_bad_prompts_get_typed_errors(tokenizer):
    processor = inputs(tokenizer, max_model_len=64)
    with pytest.raises(EmptyPromptError):
        processor.prompt_ids([])
    with pytest.raises(InvalidTokenIdError):
        processor.prompt_ids([1, 49152])
    with pytest.raises(InvalidPromptError):
        processor.prompt_ids([1.5])
    with pytest.raises(InvalidMessagesError):
        processor.chat_ids([{"role": "wizard", "content": "hi"}])
    with pytest.raises(PromptTooLongError, match="characters"):
        processor.prompt_ids("x" * (processor.max_prompt_chars + 1))
    assert processor.prompt_ids("Hello world") == encode(tokenizer, "Hello world")


def test_the_tokenize_failpoint_fires_on_text_only(tokenizer):
    processor = inputs(tokenizer, failpoints=Failpoints.parse("tokenize=1.0"))
    with pytest.raises(InjectedFault):
        processor.prompt_ids("hi")
    assert processor.prompt_ids([1, 2, 3]) == [1, 2, 3]


def test_prepare_tokenizes_the_bad_words_and_compiles_the_stop_strings_into_their_caches(tokenizer, monkeypatch):
    from metrale.text import processor
    from metrale.text.stop import compile_stops

    processor_inputs = inputs(tokenizer)
    params = SamplingParams(bad_words=[f"word{i}" for i in range(100)], stop=[f"stop{i}" for i in range(100)])
    misses = compile_stops.cache_info().misses
    processor_inputs.prepare(params)  # the engine runs this on a worker thread
    assert compile_stops.cache_info().misses == misses + 1
    OutputProcessor(tokenizer).new_request([], params)  # on the caller's thread: compiled already
    assert compile_stops.cache_info().misses == misses + 1
    calls = []
    monkeypatch.setattr(processor, "bad_words_token_ids", lambda *args: calls.append(args) or [])
    prepared = processor_inputs.params(params)  # on the caller's thread: from the cache, nothing tokenized
    assert calls == [] and len(prepared.bad_words_token_ids) >= 100
    other = processor_inputs.params(SamplingParams(bad_words=["fresh"]))  # not prepared: tokenized here
    assert len(calls) == 1 and other.bad_words_token_ids == ()
