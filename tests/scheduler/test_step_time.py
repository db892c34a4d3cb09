"""Decodes first: a long prompt is chunked to fit max_step_ms (an injected cost model) and never takes
the running streams' tokens."""

import pytest

from kvcache.manager import KVCacheManager
from scheduler import Scheduler, SchedulerConfig
from scheduler.step_cost import OnlineStepCost, StepWork
from tests.scheduler.drive import make_request, step
from tests.scheduler.test_step_cost import Linear


def make(cost_model, num_blocks=256, **config) -> Scheduler:
    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_num_batched_tokens", 256)
    cfg = SchedulerConfig(block_size=4, **config)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4, enable_prefix_caching=True), cost_model=cost_model)


def start_streams(sched: Scheduler, n: int = 4) -> None:
    """n short requests that decode for a long time, past their first token."""
    for i in range(n):
        sched.add(make_request(f"s{i}", 3, max_tokens=400, ignore_eos=True, arrival_time=float(i)))
    step(sched)


def chunks_of(out, rid):
    return [len(s.token_ids) for s in out.scheduled if s.request_id == rid]


def test_streams_decode_every_step_while_a_long_prompt_is_cut_to_the_time_target():
    model = Linear(fixed=0.010, per_token=0.001, per_pair=1e-7)
    sched = make(model, max_step_ms=50.0, min_prefill_chunk=8)
    start_streams(sched)
    sched.add(make_request("long", 600, max_tokens=1, arrival_time=10.0))
    sizes = []
    while sched.get_request("long") is not None:
        out, _ = step(sched)
        assert all(chunks_of(out, f"s{i}") == [1] for i in range(4))  # every stream, every step
        work = StepWork()
        for s in out.scheduled:
            work = work + StepWork.of_chunk(s.start_position, len(s.token_ids))
        assert model.estimate(work) <= 0.050 + 1e-12 or chunks_of(out, "long") == [8]
        sizes.append(chunks_of(out, "long")[0])
    assert sum(sizes) == 600
    assert sizes[0] == 36 - 1 and sizes[-2] < sizes[0]  # shrinks as its context grows (the last: leftovers)
    sched.check_integrity()


def test_without_decodes_a_long_prompt_keeps_the_whole_token_budget():
    sched = make(Linear(), max_step_ms=20.0)
    sched.add(make_request("long", 600, max_tokens=1))
    out, _ = step(sched)
    assert chunks_of(out, "long") == [256]


def test_without_a_time_target_chunks_are_bounded_by_tokens_only():
    sched = make(Linear(), max_num_batched_tokens=64)
    start_streams(sched)
    sched.add(make_request("long", 600, max_tokens=1, arrival_time=10.0))
    out, _ = step(sched)
    assert chunks_of(out, "long") == [60]


def test_an_earlier_long_prompt_leaves_a_token_to_each_later_decode():
    sched = make(Linear(), max_num_batched_tokens=16)
    start_streams(sched, 2)
    sched.add(make_request("long", 100, max_tokens=1, arrival_time=-1.0))  # runs ahead of the streams
    out, _ = step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("s0", 1), ("s1", 1), ("long", 14)]
    out, _ = step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("long", 14), ("s0", 1), ("s1", 1)]


def test_only_the_first_chunk_gets_the_floor_and_the_queue_head_waits():
    sched = make(Linear(fixed=0.010, per_token=0.001), max_step_ms=15.0, min_prefill_chunk=8)
    start_streams(sched)
    sched.add(make_request("p", 50, max_tokens=1, arrival_time=10.0))
    sched.add(make_request("q", 50, max_tokens=1, arrival_time=11.0))
    out, _ = step(sched)
    assert chunks_of(out, "p") == [8] and chunks_of(out, "q") == []


def test_the_engine_teaches_the_default_model_through_observe_step():
    sched = make(None, num_blocks=1024, max_step_ms=50.0, min_prefill_chunk=8)
    assert isinstance(sched.cost_model, OnlineStepCost)
    truth = Linear(fixed=0.010, per_token=0.001, per_pair=1e-7)
    start_streams(sched)
    sched.add(make_request("long", 2000, max_tokens=1, arrival_time=10.0))
    sizes = []
    for _ in range(40):
        out = sched.schedule()
        work = StepWork()
        for s in out.scheduled:
            work = work + StepWork.of_chunk(s.start_position, len(s.token_ids))
        sched.observe_step(out, truth.estimate(work))
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        sizes.append(chunks_of(out, "long")[0])
    assert sorted(sizes[:2]) == [8, 16]  # nothing learned about chunks yet: probes of two sizes
    assert sched.cost_model.estimate(StepWork(9, 99, True)) == pytest.approx(truth.estimate(StepWork(9, 99)))
    assert all(size < 36 for size in sizes[1:]) and max(sizes) > 8
    sched.check_integrity()


@pytest.mark.parametrize(("field", "value"), [("max_step_ms", 0), ("max_step_ms", float("nan")),
                                              ("max_step_ms", True), ("max_step_ms", "50"),
                                              ("min_prefill_chunk", 0)])
def test_bad_time_target_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})
