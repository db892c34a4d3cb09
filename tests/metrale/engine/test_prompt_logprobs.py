"""Prompt logprobs on a tiny random llama, against a plain full forward of mlx-lm's twin model: chunked
prefill, prefix-cache hits skipped for the asking request, and no extra lm_head rows for the others."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mlx.utils import tree_flatten

from kernels.runtime import mx
from metrale import AsyncEngine, EngineConfig, SamplingParams
from metrale.engine.runner import PromptLogprobsRow, SamplingRow, StepInput
from scheduler import ScheduledRequest, SchedulerOutput
from tests.metrale.engine.test_runner import BLOCK, tiny_runner
from tests.metrale.engine_helpers import assert_clean
from tests.metrale.model_helpers import make_twins, reference_logits, tiny_config_dict, write_tiny_gguf

pytestmark = [pytest.mark.timeout(60)]
PROMPT = [5, 9, 13, 2, 7, 40, 11, 3, 17, 4, 21, 8, 30, 6, 12, 19, 25, 14, 1, 22]  # 20 tokens


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    config_dict = tiny_config_dict()
    reference, model = make_twins(config_dict)
    path = str(tmp_path_factory.mktemp("twins") / "tiny.gguf")
    write_tiny_gguf(path, config_dict, tree_flatten(model.parameters()))
    return path, reference


def expected(reference, prompt: list[int], k: int) -> list[tuple[float, int, list[int]]]:
    """(logprob, rank, top-k ids) of prompt[1:], each given the tokens before it, from one full forward."""
    logits = np.array(reference_logits(reference, prompt), dtype=np.float64)  # (P, V)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    out = []
    for pos in range(len(prompt) - 1):
        target = prompt[pos + 1]
        row = logp[pos]
        out.append((row[target], int((row > row[target]).sum()) + 1, list(np.argsort(-row)[:k])))
    return out


def check(got, want) -> None:
    assert got[0] is None and len(got) == len(want) + 1
    for item, (logprob, rank, top) in zip(got[1:], want):
        assert math.isclose(item.logprob, logprob, abs_tol=1e-4), (item.logprob, logprob)
        assert item.rank == rank
        assert [tid for tid, _ in item.top] == top


@pytest.mark.parametrize("chunk", [8, 128])  # 8: the prompt is computed in three chunks
async def test_prompt_logprobs_match_a_full_forward(twins, chunk):
    path, reference = twins
    config = EngineConfig(model=path, kv_cache_bytes=1 << 20, block_size=BLOCK, max_num_batched_tokens=chunk,
                          max_num_seqs=4, kv_cache_dtype="float32")  # logprobs vs the float32 reference to 1e-4
    want = expected(reference, PROMPT, 3)
    async with AsyncEngine(config) as engine:
        plain = SamplingParams(max_tokens=2, temperature=0)
        first = [out async for out in engine.generate(PROMPT, plain)]  # fills the prefix cache
        assert first[0].prompt_logprobs is None and first[-1].num_cached_tokens == 0
        outs = [out async for out in engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0,
                                                                             prompt_logprobs=3))]
        check(outs[0].prompt_logprobs, want)
        assert all(out.prompt_logprobs is None for out in outs[1:])
        assert outs[-1].num_cached_tokens == 0  # computed its whole prompt: no prefix-cache read
        assert [t for o in outs for t in o.token_ids] == [t for o in first for t in o.token_ids]
        again = [out async for out in engine.generate(PROMPT, plain)]
        assert again[-1].num_cached_tokens == 16  # the 4 full blocks; the prompt's last token is never a hit
        assert_clean(engine)


def test_a_batch_without_prompt_logprobs_computes_no_extra_rows(tmp_path):
    runner, reference = tiny_runner(tmp_path)
    seen: list[int] = []
    compute = runner.model.compute_logits

    def counting(hidden):
        seen.append(hidden.shape[0])
        return compute(hidden)

    runner.model.compute_logits = counting
    greedy = SamplingParams(max_tokens=2, temperature=0)
    a, b = PROMPT[:6], PROMPT[6:9]
    out = SchedulerOutput((ScheduledRequest("a", tuple(a), 0, (7, 2), samples=True),
                           ScheduledRequest("b", tuple(b), 0, (5,), samples=True)), 9, (), BLOCK)
    rows = (SamplingRow("a", greedy, a, []), SamplingRow("b", greedy, b, []))
    plain = runner.execute(StepInput(out, rows))
    assert seen == [2] and all(row.prompt_logprobs is None for row in plain)
    asked = runner.execute(StepInput(out, rows, prompt_logprobs=(PromptLogprobsRow("b", 0, b),)))
    assert seen == [2, 4]  # b's rows at positions 0 and 1 score its tokens 1 and 2; a computes none
    (b_row,) = [row for row in asked if row.request_id == "b"]
    first, items = b_row.prompt_logprobs.first_position, b_row.prompt_logprobs.logprobs
    assert first == 1 and [i.token_id for i in items] == b[1:]
    want = expected(reference, b, 0)
    assert [round(i.logprob, 4) for i in items] == [round(float(w[0]), 4) for w in want]
    assert [row.token_ids for row in asked] == [row.token_ids for row in plain]
