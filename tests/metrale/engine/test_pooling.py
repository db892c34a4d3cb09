"""Embeddings through the engine (metrale.engine.pooling, AsyncEngine.embed) on a random Qwen3-shaped GGUF, against a
reference forward: mlx-lm's Qwen3 model over the same token ids (its final normed hidden states), pooled and
normalised by hand. Long inputs are chunked (max_num_batched_tokens 16), inputs batch with each other and with
generation, and every scenario ends with every KV block free."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from mlx.utils import tree_flatten

from kernels.runtime import mx
from metrale import LLM, AsyncEngine, EngineConfig, SamplingParams
from metrale.errors import (EmptyPromptError, InvalidParamsError, InvalidTokenIdError, PromptTooLongError,
                            QueueFullError)
from metrale.pooling_params import MAX_EMBED_INPUTS, PoolingParams
from tests.metrale.arch_helpers import arch_folder, load_reference, random_prompts
from tests.metrale.engine_helpers import assert_clean, wait_idle
from tests.metrale.gguf_helpers import write_arch_gguf

from metrale.loading import load_model  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]
# float32 weights and KV on both sides; chunks and batches reorder float32 sums only
ATOL = 2e-5
LENGTHS = [40, 1, 7, 23, 16, 3, 31, 12]  # 40 and 31 take several 16-token chunks
PROMPTS = random_prompts(101, LENGTHS)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(GGUF path, mlx-lm reference model): a random tiny Qwen3 written as llama.cpp's converter writes it."""
    root = tmp_path_factory.mktemp("qwen3-embed")
    folder = arch_folder(root, "qwen3")
    loaded = load_model(str(folder), dtype=mx.float32)
    params = {k: np.array(v) for k, v in tree_flatten(loaded.model.parameters())}
    path = write_arch_gguf(root / "qwen3.gguf", loaded.config, params)
    reference, _ = load_reference(folder)
    return str(path), reference


def config(path: str, **overrides) -> EngineConfig:
    return EngineConfig(**{"model": path, "dtype": "float32", "kv_cache_dtype": "float32", "kv_cache_bytes": 4 << 20,
                           "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8, **overrides})


def expected(reference, prompt: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
    hidden = np.array(reference.model(mx.array([prompt]))[0], dtype=np.float64)  # (L, D), after the final norm
    vector = {"last": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[pooling]
    return vector / np.linalg.norm(vector) if normalize else vector


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
async def test_vectors_equal_the_reference_forward_pooled_by_hand(qwen3, pooling):
    path, reference = qwen3
    async with AsyncEngine(config(path, pooling=pooling)) as engine:
        results = await engine.embed(PROMPTS)
        await wait_idle(engine)
        assert_clean(engine)
    for prompt, result in zip(PROMPTS, results):
        assert result.num_prompt_tokens == len(prompt) and result.dimensions == 64
        np.testing.assert_allclose(result.embedding, expected(reference, prompt, pooling), atol=ATOL)


async def test_an_input_alone_equals_it_in_a_batch_and_beside_generation(qwen3):
    path, _ = qwen3
    async with AsyncEngine(config(path, pooling="mean")) as engine:
        alone = [(await engine.embed([p]))[0].embedding for p in PROMPTS]
        batched = [r.embedding for r in await engine.embed(PROMPTS)]
        generating = [engine.generate(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS[:4]]
        beside, *texts = await asyncio.gather(engine.embed(PROMPTS), *(_drain(s) for s in generating))
        await wait_idle(engine)
        assert_clean(engine)
    assert all(n == 12 for n in texts)
    for one, many, mixed in zip(alone, batched, (r.embedding for r in beside)):
        np.testing.assert_allclose(many, one, atol=ATOL)
        np.testing.assert_allclose(mixed, one, atol=ATOL)


async def _drain(stream) -> int:
    return sum([len(out.token_ids) async for out in stream])


async def test_dimensions_truncate_then_renormalise_on_a_matryoshka_model(qwen3):
    path, reference = qwen3
    async with AsyncEngine(config(path, matryoshka=True)) as engine:
        (short,) = await engine.embed([PROMPTS[0]], PoolingParams(dimensions=16))
        (raw,) = await engine.embed([PROMPTS[0]], PoolingParams(normalize=False))
        with pytest.raises(InvalidParamsError, match="hidden size"):
            await engine.embed([PROMPTS[0]], PoolingParams(dimensions=65))
    full = expected(reference, PROMPTS[0], "last", normalize=False)
    np.testing.assert_allclose(raw.embedding, full, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(short.embedding, full[:16] / np.linalg.norm(full[:16]), atol=ATOL)


@pytest.mark.parametrize(("prompts", "params", "error"), [
    ([[5]] * (MAX_EMBED_INPUTS + 1), None, InvalidParamsError),
    ([[5, 6], [7] * 200], None, PromptTooLongError),  # max_model_len 128
    ([[5, 6], []], None, EmptyPromptError),
    ([[5, 6], [5, 101]], None, InvalidTokenIdError),
    ([[5, 6]], PoolingParams(dimensions=8), InvalidParamsError),  # not a Matryoshka model
])
async def test_bad_input_is_refused_and_queues_nothing(qwen3, prompts, params, error):
    path, _ = qwen3
    async with AsyncEngine(config(path, max_model_len=128)) as engine:
        with pytest.raises(error):
            await engine.embed(prompts, params)
        stats = engine.stats()
        assert stats.num_steps == 0 and stats.requests_unfinished == 0 and stats.requests_finished == 0
        assert_clean(engine)


async def test_truncate_prompt_tokens_keeps_the_last_tokens(qwen3):
    path, _ = qwen3
    long = PROMPTS[0] * 5  # 200 tokens
    async with AsyncEngine(config(path, max_model_len=128)) as engine:
        (cut,) = await engine.embed([long], PoolingParams(truncate_prompt_tokens=40))
        (whole,) = await engine.embed([long], PoolingParams(truncate_prompt_tokens=-1))
        (tail,) = await engine.embed([long[-40:]])
    assert cut.num_prompt_tokens == 40 and whole.num_prompt_tokens == 127
    np.testing.assert_allclose(cut.embedding, tail.embedding, atol=ATOL)


async def test_right_truncation_keeps_the_first_tokens(qwen3):
    path, _ = qwen3
    long = PROMPTS[0] * 5  # 200 tokens
    async with AsyncEngine(config(path, max_model_len=128)) as engine:
        (cut,) = await engine.embed([long], PoolingParams(truncate_prompt_tokens=40, truncation_side="right"))
        (head,) = await engine.embed([long[:40]])
    assert cut.num_prompt_tokens == 40
    np.testing.assert_allclose(cut.embedding, head.embedding, atol=ATOL)


def test_a_bad_truncation_side_names_it():
    with pytest.raises(InvalidParamsError, match="truncation_side"):
        PoolingParams(truncation_side="middle")


async def test_cancelling_an_embedding_call_aborts_its_inputs_and_frees_their_blocks(qwen3):
    path, _ = qwen3
    async with AsyncEngine(config(path)) as engine:
        task = asyncio.ensure_future(engine.embed(PROMPTS * 4))
        while engine.stats().num_steps < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)
        assert_clean(engine)
        finished = _by_reason(engine)
    assert finished["abort"] > 0 and finished["abort"] + finished["stop"] == len(PROMPTS) * 4


def _by_reason(engine) -> dict[str, float]:
    """metrale_request_success_total per finished_reason."""
    out = {"abort": 0.0, "stop": 0.0}
    for metric in engine.registry.collect():
        for sample in metric.samples:
            if sample.name == "metrale_request_success_total":
                out[sample.labels["finished_reason"]] = sample.value
    return out


async def test_prompt_tokens_are_counted_in_the_metrics(qwen3):
    path, _ = qwen3
    async with AsyncEngine(config(path)) as engine:
        await engine.embed(PROMPTS)
        exposition = engine.metrics_exposition().decode()
        finished = _by_reason(engine)
    counted = [line for line in exposition.splitlines() if line.startswith("metrale_prompt_tokens_total{")]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) == sum(LENGTHS)
    assert finished["stop"] == len(PROMPTS)  # each input is one finished request, as vLLM counts pooling requests


@pytest.mark.parametrize("engine_process", [False, True])
async def test_the_engine_process_carries_the_vectors(qwen3, engine_process):
    path, reference = qwen3
    async with AsyncEngine(config(path, engine_process=engine_process)) as engine:
        results = await engine.embed(PROMPTS[:3])
        await wait_idle(engine)
        assert_clean(engine)
    for prompt, result in zip(PROMPTS, results):
        np.testing.assert_allclose(result.embedding, expected(reference, prompt, "last"), atol=ATOL)


async def test_an_embedding_request_never_holds_more_inputs_than_the_waiting_queue(qwen3):
    path, _ = qwen3
    async with AsyncEngine(config(path, max_waiting=4)) as engine:
        with pytest.raises(InvalidParamsError, match="max_waiting 4"):
            await engine.embed(PROMPTS[:5])
        assert len(await engine.embed(PROMPTS[:4])) == 4
        await wait_idle(engine)
        assert_clean(engine)


async def test_a_full_queue_while_queueing_aborts_the_inputs_already_queued(qwen3):
    path, _ = qwen3
    async with AsyncEngine(config(path, max_waiting=4)) as engine:
        waiting = engine.generate(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))  # one seat taken
        with pytest.raises(QueueFullError):
            await engine.embed(PROMPTS[:4])  # the 4th finds the queue full: the 3 before it are aborted
        assert await _drain(waiting) == 2
        await wait_idle(engine)
        assert_clean(engine)
        assert _by_reason(engine) == {"abort": 3, "stop": 0, "length": 1, "error": 0}


def test_the_blocking_llm_embeds(qwen3):
    path, reference = qwen3
    with LLM(config(path)) as llm:
        one, = llm.embed(PROMPTS[1])
        many = llm.embed(PROMPTS[:3])
    np.testing.assert_allclose(one.embedding, many[1].embedding, atol=ATOL)
    np.testing.assert_allclose(many[2].embedding, expected(reference, PROMPTS[2], "last"), atol=ATOL)


async def test_many_texts_are_tokenized_off_the_event_loop_to_the_same_vectors(qwen3):
    path, _ = qwen3
    text = "ab" * 30  # 300 of them: 18,000 characters, more than Submission tokenizes on the event loop
    async with AsyncEngine(config(path, max_model_len=128)) as engine:
        (alone,) = await engine.embed([text])
        many = await engine.embed([text] * 300)
        assert engine._submission._tokenize_thread is not None  # the worker thread did it
    for result in many:
        np.testing.assert_allclose(result.embedding, alone.embedding, atol=ATOL)
