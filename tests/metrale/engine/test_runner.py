"""ModelRunner on a tiny random llama: one batched step equals the reference model's greedy tokens."""

from __future__ import annotations

import numpy as np
from mlx.utils import tree_flatten

from metrale.config import EngineConfig
from metrale.engine.runner import ModelRunner, SamplingRow, StepInput
from metrale.sampling_params import SamplingParams
from scheduler import ScheduledRequest, SchedulerOutput
from tests.metrale.model_helpers import make_twins, reference_logits, tiny_config_dict, write_tiny_gguf

BLOCK = 4


def tiny_runner(tmp_path) -> tuple[ModelRunner, object]:
    config_dict = tiny_config_dict()
    reference, model = make_twins(config_dict)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(str(path), config_dict, tree_flatten(model.parameters()))
    # a float32 cache: callers compare logprobs with the float32 reference to 1e-4
    runner = ModelRunner.load(EngineConfig(model=str(path), kv_cache_bytes=1 << 20, block_size=BLOCK,
                                           kv_cache_dtype="float32"))
    return runner, reference


def scheduled(request_id: str, tokens: list[int], start: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(request_id, tuple(tokens), start, tuple(blocks), samples=True)


def test_prefill_and_decode_in_one_step_match_the_reference(tmp_path):
    runner, reference = tiny_runner(tmp_path)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    a, b = [5, 9, 13, 2, 7, 40], [3, 17, 4]
    first = SchedulerOutput((scheduled("a", a, 0, [7, 2]), scheduled("b", b, 0, [5])), len(a) + len(b), (), BLOCK)
    rows = (SamplingRow("a", greedy, a, []), SamplingRow("b", greedy, b, []))
    out = {row.request_id: row.token_ids[0] for row in runner.execute(StepInput(first, rows))}
    expect_a = int(np.argmax(np.array(reference_logits(reference, a)[-1])))
    expect_b = int(np.argmax(np.array(reference_logits(reference, b)[-1])))
    assert out == {"a": expect_a, "b": expect_b}
    # the next step decodes b's sampled token over the KV the first step wrote
    second = SchedulerOutput((scheduled("b", [expect_b], len(b), [5]),), 1, (), BLOCK)
    (row,) = runner.execute(StepInput(second, (SamplingRow("b", greedy, b, [expect_b]),)))
    assert row.request_id == "b" and row.token_ids[0] == int(np.argmax(np.array(reference_logits(reference, b + [expect_b])[-1])))


def test_a_step_that_samples_nothing_only_fills_the_pools(tmp_path):
    runner, _ = tiny_runner(tmp_path)
    chunk = ScheduledRequest("a", (1, 2, 3, 4), 0, (3,), samples=False)
    result = runner.execute(StepInput(SchedulerOutput((chunk,), 4, (), BLOCK), ()))
    assert result == []
    k_pool, _ = runner.kv_cache.layer(0)
    assert np.abs(np.array(k_pool[3])).sum() > 0  # block 3 now holds their keys
