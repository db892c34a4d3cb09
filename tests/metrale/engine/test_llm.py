"""LLM, the blocking API: on a tiny random llama (fast), and once on the real default model.

Every way of ending a request early is made deterministic with a StepGate: the engine may run a
given number of steps, then holds the next one until an abort is pending, so a request cannot
reach its end by itself while the test ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections.abc import Iterator

import pytest
from mlx.utils import tree_flatten
from prometheus_client import CollectorRegistry

from metrale import (LLM, AsyncEngine, CompletionResult, EngineConfig, EngineNotRunningError, RequestFailedError,
                     RequestRejectedError, SamplingParams)
from metrale.engine.async_engine import collect_result
from metrale.errors import InvalidMessagesError, PromptTooLongError
from tests.metrale.engine_helpers import Runners
from tests.metrale.model_helpers import make_twins, tiny_config_dict, write_tiny_gguf

pytestmark = pytest.mark.timeout(60)

PROMPTS = ["hello world", "abc", [5, 6, 7, 8], "the quick brown fox"]
ROOT = str(Path(__file__).resolve().parents[3])
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)  # cannot end by itself under a gate


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> EngineConfig:
    config_dict = tiny_config_dict()
    _, model = make_twins(config_dict)
    path = tmp_path_factory.mktemp("llm") / "tiny.gguf"
    write_tiny_gguf(str(path), config_dict, tree_flatten(model.parameters()))
    return EngineConfig(model=str(path), kv_cache_bytes=1 << 20, block_size=4)


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(scope="module")
def runners() -> Runners:
    return Runners()


@pytest.fixture(scope="module")
def llm(tiny_config, registry, runners) -> Iterator[LLM]:
    with LLM(tiny_config, registry=registry, runner_factory=runners) as llm:
        yield llm


@pytest.fixture(autouse=True)
def ends_clean(request):
    yield
    if "llm" in request.fixturenames:
        wait_clean(request.getfixturevalue("llm"))


def wait_clean(llm: LLM, timeout_s: float = 30.0) -> None:
    """Wait until nothing runs or waits (an abort lands at a step boundary), then the integrity check."""
    deadline = time.monotonic() + timeout_s
    while (stats := llm.stats()).running or stats.waiting:
        if time.monotonic() > deadline:
            pytest.fail(f"engine not idle after {timeout_s} s: {stats}")
        time.sleep(0.01)
    llm.check_integrity()
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats


def aborted(llm: LLM, registry: CollectorRegistry) -> float:
    labels = {"model_name": llm.model_name, "finished_reason": "abort"}
    return registry.get_sample_value("metrale_request_success_total", labels) or 0.0


class StepGate:
    """A runner hook: `steps` steps run, then each next one waits until an abort is pending, the LLM
    is closing or the gate is opened. `held` is set when a step first waits; `batch_sizes` records
    each step's sampled rows."""

    def __init__(self, llm: LLM, steps: int) -> None:
        self._llm = llm
        self._left = steps
        self._open = threading.Event()
        self.held = threading.Event()
        self.batch_sizes: list[int] = []

    def __call__(self, step) -> None:
        if self._left > 0:
            self._left -= 1
        else:
            self.held.set()
            deadline = time.monotonic() + 30  # a hang guard, not a timing assert
            while not (self._open.is_set() or self._abort_pending() or self._llm.closed):
                if time.monotonic() > deadline:
                    raise RuntimeError("StepGate: never opened and no abort arrived")
                time.sleep(0.002)
        self.batch_sizes.append(len(step.sampling_rows))

    def open(self) -> None:
        self._open.set()

    def _abort_pending(self) -> bool:
        # The one private read left in the engine tests: no public API says that an abort was handed over
        # and waits for the step boundary (EngineCore keeps it to itself).
        return bool(self._llm._engine._core._pending_aborts)


@contextlib.contextmanager
def gate(llm: LLM, runners: Runners, steps: int) -> Iterator[StepGate]:
    step_gate = StepGate(llm, steps)
    try:
        with runners.hooked(step_gate):
            yield step_gate
    finally:
        step_gate.open()


def same(result: CompletionResult, other: CompletionResult) -> bool:
    return (result.text, result.token_ids, result.finish_reason, result.usage) == (
        other.text, other.token_ids, other.finish_reason, other.usage)


# ---- results ----

def test_generate_equals_the_async_api(llm, tiny_config):
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0),
              SamplingParams(max_tokens=16, temperature=1.0, top_k=5, seed=3, ignore_eos=True)]
    messages = [{"role": "user", "content": "hi there"}]

    async def reference():
        async with AsyncEngine(tiny_config) as engine:
            completions = [await engine.complete(p, sp) for p, sp in zip(PROMPTS, params)]
            chat = await collect_result(engine.chat(messages, params[0]))
            return completions, chat

    expected, expected_chat = asyncio.run(reference())
    results = llm.generate(PROMPTS, params)
    assert len(results) == len(PROMPTS) and all(same(r, e) for r, e in zip(results, expected))
    assert same(llm.chat(messages, params[0])[0], expected_chat)
    # one prompt (text or token ids) is a list of one; one SamplingParams serves every prompt
    assert same(llm.generate(PROMPTS[0], params[0])[0], expected[0])
    assert same(llm.generate(PROMPTS[2], params[2])[0], expected[2])
    greedy = llm.generate(PROMPTS, params[0])
    assert [len(r.token_ids) for r in greedy] == [12] * len(PROMPTS)


def test_stream_and_callback_equal_generate(llm):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = llm.generate(PROMPTS[1], params)[0]
    with llm.stream(PROMPTS[1], params) as deltas:
        outs = list(deltas)
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert same(CompletionResult.from_outputs(deltas.request_id, outs), expected)
    calls = []
    result = llm.generate_streaming(PROMPTS[1], params, lambda token_id, text: calls.append((token_id, text)))
    assert same(result, expected)
    assert [t for t, _ in calls] == expected.token_ids and "".join(s for _, s in calls) == expected.text


def test_chat_takes_one_conversation_or_a_list(llm):
    params = SamplingParams(max_tokens=4, temperature=0)
    one = [{"role": "user", "content": "hi"}]
    two = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}]
    results = llm.chat([one, two], params)
    expected = llm.chat(one, params) + llm.chat(two, params)
    assert len(results) == 2 and all(same(r, e) for r, e in zip(results, expected))
    with pytest.raises(InvalidMessagesError):
        llm.chat([{"role": "user"}], params)


def test_progress_line_is_off_by_default(llm, capsys):
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2))
    assert capsys.readouterr().err == ""
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=2), progress=True)
    assert capsys.readouterr().err.endswith("3/3 requests done\n")


# ---- rejections and failures ----

def test_a_rejected_prompt_rejects_the_whole_list_before_any_step(llm):
    before_steps, before_finished = llm.stats().num_steps, llm.stats().requests_finished
    too_long = [1] * 300  # max_model_len of the tiny model is 256
    with pytest.raises(PromptTooLongError) as caught:
        llm.generate([PROMPTS[0], too_long, PROMPTS[1]], SamplingParams(max_tokens=4))
    assert isinstance(caught.value, RequestRejectedError)
    wait_clean(llm)
    stats = llm.stats()
    assert stats.num_steps == before_steps  # the first prompt was queued, then aborted unscheduled
    assert stats.requests_finished == before_finished + 1
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS[:3], [SamplingParams(), SamplingParams()])
    for call in (lambda: llm.generate(PROMPTS[:2], SamplingParams(n=2)),
                 lambda: llm.chat([{"role": "user", "content": "hi"}], [SamplingParams(n=3)]),
                 lambda: llm.generate_streaming(PROMPTS[0], SamplingParams(n=2), lambda *_: None)):
        with pytest.raises(ValueError, match="n must be 1 here"):  # one result per prompt
            call()
    assert llm.stats().requests_finished == before_finished + 1  # nothing was queued
    with pytest.raises(RequestRejectedError):
        llm.stream(too_long)


def test_a_list_longer_than_the_waiting_queue_runs_in_waves(llm, tiny_config):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [f"{word} number {i}" for i, word in enumerate(["alpha", "beta", "gamma"] * 3)]
    expected = llm.generate(prompts, params)
    small_registry = CollectorRegistry()
    with LLM(EngineConfig(model=tiny_config.model, kv_cache_bytes=1 << 20, block_size=4, max_waiting=2),
             registry=small_registry) as small:
        assert all(same(r, e) for r, e in zip(small.generate(prompts, params), expected))
        with pytest.raises(PromptTooLongError):  # a rejection in a later wave aborts what is still running
            small.generate(prompts + [[1] * 300], params)
        wait_clean(small)
        labels = {"model_name": small.model_name, "reason": "queue_full"}
        assert small_registry.get_sample_value("metrale_requests_rejected_total", labels) == 0.0


def test_a_failed_step_raises_request_failed_and_the_engine_goes_on(llm, runners):
    def failing(step):
        raise RuntimeError("injected forward failure")

    with runners.hooked(failing):
        with pytest.raises(RequestFailedError, match="injected forward failure"):
            llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4))
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=3))[0].finish_reason == "length"


# ---- ending early frees the blocks ----

def test_breaking_out_of_a_for_aborts(llm, registry, runners):
    before = aborted(llm, registry)
    with gate(llm, runners, steps=2):
        for out in llm.stream(PROMPTS[0], LONG):
            break  # the iterator is dropped here, which hands the abort over
        wait_clean(llm)
    assert aborted(llm, registry) == before + 1


def test_an_exception_in_the_consumer_aborts(llm, registry, runners):
    before = aborted(llm, registry)

    def consume():
        for out in llm.stream(PROMPTS[0], LONG):
            raise ValueError("consumer broke")

    with gate(llm, runners, steps=2):
        with pytest.raises(ValueError, match="consumer broke"):
            consume()
        wait_clean(llm)
    assert aborted(llm, registry) == before + 1


def test_close_and_with_abort_and_return_with_the_blocks_free(llm, registry, runners):
    before = aborted(llm, registry)
    with gate(llm, runners, steps=2):
        with llm.stream(PROMPTS[0], LONG) as deltas:
            next(deltas)
        stats = llm.stats()  # no waiting: close() returned after the final delta
        assert stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    with gate(llm, runners, steps=2):
        kept = llm.stream(PROMPTS[1], LONG)
        next(kept)
        kept.close()
        kept.close()  # idempotent
        assert list(kept) == []
    assert aborted(llm, registry) == before + 2


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_an_exception_in_on_token_aborts_and_propagates(llm, registry, runners, error):
    before = aborted(llm, registry)

    def on_token(token_id, text):
        raise error("from the callback")

    with gate(llm, runners, steps=2):
        with pytest.raises(error, match="from the callback"):
            llm.generate_streaming(PROMPTS[0], LONG, on_token)
        stats = llm.stats()
        assert stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert aborted(llm, registry) == before + 1


@pytest.mark.skipif(signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                    reason="SIGINT is not Python's KeyboardInterrupt here")
def test_ctrl_c_while_generate_waits_aborts_the_batch(llm, registry, runners):
    assert threading.current_thread() is threading.main_thread()
    before = aborted(llm, registry)
    with gate(llm, runners, steps=2) as step_gate:
        def interrupt():
            step_gate.held.wait(30)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        sender = threading.Thread(target=interrupt)
        sender.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS, LONG)
        finally:
            sender.join()
        wait_clean(llm)
    assert aborted(llm, registry) == before + len(PROMPTS)


# ---- threads ----

def test_two_threads_at_once_batch_together(llm, runners):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = llm.generate(PROMPTS, params)
    results: dict[str, list[CompletionResult]] = {}
    with gate(llm, runners, steps=1) as step_gate:
        threads = [threading.Thread(target=lambda name=name: results.__setitem__(name, llm.generate(PROMPTS, params)))
                   for name in ("a", "b")]
        threads[0].start()
        step_gate.held.wait(30)  # the first thread's requests are in, its second step is held
        threads[1].start()
        deadline = time.monotonic() + 30
        while (stats := llm.stats()).running + stats.waiting < 2 * len(PROMPTS):
            assert time.monotonic() < deadline, stats
            time.sleep(0.01)
        step_gate.open()
        for thread in threads:
            thread.join(30)
    assert all(same(r, e) for name in "ab" for r, e in zip(results[name], expected))
    assert max(step_gate.batch_sizes) == 2 * len(PROMPTS)  # one step sampled for both threads' requests


# ---- lifecycle ----

def test_close_frees_everything_and_stops_its_threads(tiny_config):
    before = set(threading.enumerate())
    runners = Runners()
    llm = LLM(tiny_config, runner_factory=runners)
    kept = llm.stream(PROMPTS[0], LONG)
    next(kept)
    waiting: list[object] = []
    other = threading.Thread(target=lambda: waiting.append(_outcome(llm)))
    with gate(llm, runners, steps=0) as step_gate:
        other.start()
        step_gate.held.wait(30)
        llm.close()
    other.join(30)
    assert not other.is_alive()
    assert waiting[0] in ("abort", EngineNotRunningError)
    assert set(threading.enumerate()) <= before  # the loop, MLX and to_thread workers have ended
    llm.check_integrity()  # the loop is gone: these read the stopped engine
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.health == "stopped"
    llm.close()  # idempotent
    assert llm.closed
    with pytest.raises(EngineNotRunningError, match="closed"):
        llm.generate("abc")
    with pytest.raises(EngineNotRunningError, match="closed"):
        next(kept)
    kept.close()  # nothing left to abort


def _outcome(llm: LLM) -> object:
    try:
        return llm.generate(PROMPTS, LONG)[0].finish_reason
    except EngineNotRunningError:
        return EngineNotRunningError


def test_a_dropped_llm_ends_its_threads_without_waiting(tiny_config):
    before = set(threading.enumerate())
    llm = LLM(tiny_config)
    threads = [thread for thread in threading.enumerate() if thread not in before]  # its loop and MLX threads
    assert {thread.name.rsplit("_", 1)[0] for thread in threads} >= {"metrale-llm", "metrale-mlx"}
    del llm
    gc.collect()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)


EXIT_WITHOUT_CLOSE = """
import sys
from metrale import LLM, EngineConfig, SamplingParams
llm = LLM(EngineConfig(model=sys.argv[1], kv_cache_bytes=1 << 20, block_size=4))
if sys.argv[2] == "streaming":  # exit with a request still running
    stream = llm.stream("hello", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    next(iter(stream))
else:
    llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0))
if sys.argv[2] == "dropped":
    del llm
print("done", flush=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ending", ["open", "dropped", "streaming"])
def test_a_script_that_never_closes_its_llm_exits_cleanly(tiny_config, ending):
    """Left open, dropped, or with a request running when the interpreter exits: the exit hook closes it before
    MLX's static destructors run (without it 4 of 6 such exits aborted with status 134). Three runs each: the
    abort was a race."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, tiny_config.model, ending],
                             capture_output=True, text=True, env=env, timeout=120)
        assert (out.returncode, out.stdout.strip()) == (0, "done"), out.stderr[-2000:]
        assert "Traceback" not in out.stderr and "terminate" not in out.stderr, out.stderr[-2000:]


def test_a_model_that_fails_to_load_leaves_no_thread(tmp_path):
    before = set(threading.enumerate())
    with pytest.raises(FileNotFoundError):
        LLM(EngineConfig(model=str(tmp_path / "missing.gguf")))
    assert set(threading.enumerate()) <= before


# ---- the real default model ----

@pytest.mark.real_model
def test_real_model_greedy_equals_async_complete():
    prompts = ["The capital of Italy is", "def fibonacci(n):", "Water boils at"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(EngineConfig(kv_cache_bytes=256 << 20)) as llm:
        results = llm.generate(prompts, params)
        alone = [llm.generate(prompt, params)[0] for prompt in prompts]
        assert all(same(r, a) for r, a in zip(results, alone))
        assert [len(r.token_ids) for r in results] == [12, 12, 12]
        wait_clean(llm)
