"""AsyncEngine with client-sized work (issue #21, tiny real model): bad words and stop strings are
tokenized / compiled by `prepare` on a worker thread, never on the event loop, and what `generate`
then does with them is a cache hit."""

from __future__ import annotations

import threading
import uuid

import pytest

from metrale import AsyncEngine, EngineConfig, SamplingParams
from metrale.sampling_params import MAX_BAD_WORDS, MAX_STOP_STRINGS
from metrale.text import processor, stop
from tests.metrale.engine_helpers import assert_clean, collect, wait_idle

pytestmark = [pytest.mark.timeout(60), pytest.mark.both_loops]

PROMPT = [5, 30, 7, 60, 11, 40, 9, 50, 13]


async def test_prepare_tokenizes_bad_words_and_compiles_stop_strings_off_the_event_loop(tiny_model, monkeypatch):
    threads: dict[str, list[str]] = {"bad_words": [], "stop": []}
    tokenize, compile_automaton = processor.bad_words_token_ids, stop.StopAutomaton.__init__

    def tokenize_spy(tokenizer, words):
        threads["bad_words"].append(threading.current_thread().name)
        return tokenize(tokenizer, words)

    def compile_spy(self, stops):
        threads["stop"].append(threading.current_thread().name)
        compile_automaton(self, stops)

    monkeypatch.setattr(processor, "bad_words_token_ids", tokenize_spy)
    monkeypatch.setattr(stop.StopAutomaton, "__init__", compile_spy)
    fresh = uuid.uuid4().hex[:6]  # stop automata are cached process-wide: new strings for each run
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                            bad_words=[f"bad word {fresh} {i}" for i in range(MAX_BAD_WORDS)],
                            stop=[f"~never {fresh} {i}~" for i in range(MAX_STOP_STRINGS)])
    async with AsyncEngine(EngineConfig(model=tiny_model, kv_cache_bytes=2 << 20, block_size=4)) as engine:
        await engine.prepare(params)
        _, _, finish = await collect(engine.generate(PROMPT, params))
        assert finish == "length"
        assert threads == {"bad_words": ["metrale-tokenize_0"], "stop": ["metrale-tokenize_0"]}
        small = SamplingParams(max_tokens=2, stop=[f"~{fresh}~"], bad_words=[fresh])  # a few characters: on the caller's thread
        await engine.prepare(small)
        await collect(engine.generate(PROMPT, small))
        assert threads["bad_words"][1] == threads["stop"][1] == threading.current_thread().name
        await wait_idle(engine)
        assert_clean(engine)
