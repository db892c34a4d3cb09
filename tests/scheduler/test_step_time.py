"""Decodes first: a long prompt is chunked to fit max_step_ms (an injected cost model) and never takes
the running streams' tokens."""

import pytest

from kvcache.manager import KVCacheManager
from scheduler import RequestStatus, Scheduler, SchedulerConfig
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
        sizes.extend(chunks_of(out, "long") or [0])  # 0: a step that measures the decodes alone
    assert sorted(sizes[:2]) == [8, 16]  # nothing learned about chunks yet: probes of two sizes
    assert sched.cost_model.estimate(StepWork(9, 99, True)) == pytest.approx(truth.estimate(StepWork(9, 99)))
    assert all(size < 36 for size in sizes[1:]) and max(sizes) > 8
    assert 1 <= sizes.count(0) <= 40 // 16 + 1  # decode-only steps, when those it knows are 16 chunk steps old
    sched.check_integrity()


@pytest.mark.parametrize(("field", "value"), [("max_step_ms", 0), ("max_step_ms", float("nan")),
                                              ("max_step_ms", True), ("max_step_ms", "50"),
                                              ("max_step_factor", 1.0), ("max_step_factor", float("nan")),
                                              ("max_step_factor", False), ("max_step_factor", 1001),
                                              ("min_prefill_chunk", 0)])
def test_bad_time_target_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_under_a_relative_limit_streams_decode_every_step_and_the_prompt_finishes():
    model = Linear(fixed=0.010, per_token=0.001, per_pair=1e-7)
    sched = make(model, max_step_factor=2.0, min_prefill_chunk=1)
    start_streams(sched)
    sched.add(make_request("long", 600, max_tokens=1, arrival_time=10.0))
    sizes = []
    while sched.get_request("long") is not None:
        assert len(sizes) < 600  # the prompt progresses every step: it cannot starve
        out, _ = step(sched)
        assert all(chunks_of(out, f"s{i}") == [1] for i in range(4))  # every stream, every step
        decodes, work = StepWork(), StepWork()
        for s in out.scheduled:
            part = StepWork.of_chunk(s.start_position, len(s.token_ids))
            work = work + part
            decodes = decodes + (part if s.request_id != "long" else StepWork())
        assert sched.last_step_limit == pytest.approx(2 * model.estimate(decodes))
        assert model.estimate(work) <= sched.last_step_limit * (1 + 1e-9) or chunks_of(out, "long") == [1]
        sizes.append(chunks_of(out, "long")[0])
    assert sum(sizes) == 600 and max(sizes) <= 14
    for i in range(4):
        sched.finish(f"s{i}", RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks  # every block freed


def test_the_relative_limit_follows_the_decode_step_the_engine_teaches():
    sched = make(None, num_blocks=1024, max_step_factor=2.0, min_prefill_chunk=1)
    start_streams(sched)
    sched.add(make_request("long", 2000, max_tokens=1, arrival_time=10.0))
    slowdown = 1.0
    sizes = []
    for n in range(120):
        if n == 60:
            slowdown = 3.0  # the machine gets busy: every step takes 3x as long
        out = sched.schedule()
        work = StepWork()
        for s in out.scheduled:
            work = work + StepWork.of_chunk(s.start_position, len(s.token_ids))
        sched.observe_step(out, slowdown * (0.010 + 0.001 * work.num_tokens + 1e-8 * work.num_attention_pairs))
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        if chunks_of(out, "long"):  # not a step that measures the decodes alone
            sizes.append((chunks_of(out, "long")[0], sched.last_step_limit))
    # learned (after the probes), the chunk leaves the streams' step at 2x their decode-only time; once the
    # windows hold only slow steps, the limit is 3x longer in seconds and the chunks keep their size
    settled, slowed = sizes[35:55], sizes[90:110]
    assert min(limit for _, limit in slowed) > 2.5 * max(limit for _, limit in settled)
    assert abs(sum(c for c, _ in slowed) / 20 - sum(c for c, _ in settled) / 20) <= 1
    assert len(sizes) < 120
    assert all(c >= 1 for c, _ in sizes) and all(c <= 13 for c, _ in settled + slowed)
    sched.check_integrity()


def true_step_seconds(out, per_context: float) -> float:
    """A fake clock: what a step takes on a made-up machine whose attention reads cost per context token."""
    work = StepWork.of_output(out)
    return 0.010 + 0.001 * work.num_tokens + 1e-8 * work.num_attention_pairs + per_context * work.num_context_tokens


def run_long_prompt(sched: Scheduler, per_context: float, prompt: int) -> list[tuple[int, float, float]]:
    """4 streams and one long prompt, the cost model taught by the fake clock: per step with a chunk, (its
    tokens, its seconds, its limit); then the streams end and every block must be free."""
    start_streams(sched)
    sched.add(make_request("long", prompt, max_tokens=1, arrival_time=10.0))
    steps = []
    while sched.get_request("long") is not None:
        assert len(steps) < prompt  # the prompt progresses: it cannot starve
        out = sched.schedule()
        seconds = true_step_seconds(out, per_context)
        sched.observe_step(out, seconds)
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
        assert all(chunks_of(out, f"s{i}") == [1] for i in range(4))  # every stream, every step
        if chunks_of(out, "long"):
            steps.append((chunks_of(out, "long")[0], seconds, sched.last_step_limit))
    for i in range(4):
        sched.finish(f"s{i}", RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks  # every block freed
    return steps


def test_a_learned_relative_limit_holds_when_chunks_cost_their_context_reads():
    sched = make(None, num_blocks=1024, max_step_factor=2.0, min_prefill_chunk=1)
    steps = run_long_prompt(sched, per_context=5e-6, prompt=1200)
    learned = steps[20:]  # after the probes and the first fits
    assert sum(n for n, _, _ in steps) == 1200
    assert all(seconds <= 1.02 * limit for _, seconds, limit in learned)  # exact clock: the fit is exact
    assert max(seconds / limit for _, seconds, limit in learned) > 0.9  # and the chunks fill the step


def test_when_no_chunk_fits_the_limit_the_prompt_moves_by_the_knee_not_a_token():
    sched = make(None, num_blocks=1024, max_step_factor=2.0, min_prefill_chunk=1)
    steps = run_long_prompt(sched, per_context=5e-5, prompt=2000)  # 50 ms a chunk at 1000: over 2x the decodes
    over = [(n, seconds, limit) for n, seconds, limit in steps[20:] if seconds > limit]
    assert over  # from some context on, nothing fits: those steps are over the limit anyway
    # ...and each takes ~a chunk's fixed cost in tokens (one more token costs ~1 ms + its attention)
    assert all(n >= 10 for n, _, _ in over)
    assert sum(n for n, _, _ in steps) == 2000 and len(steps) < 120  # 1-token chunks: ~1,000 steps


def test_steps_of_decodes_alone_do_not_refit_the_learned_model(monkeypatch):
    """The engine observes every step; only a step that sizes a prompt chunk needs the fit. Refitting for
    each decode step (to log its estimate) cost 0.4-0.8 ms of the engine's thread per token."""
    from scheduler import step_cost

    sched = make(None, num_blocks=1024, max_step_factor=8.0, min_prefill_chunk=1)
    run_long_prompt(sched, per_context=5e-6, prompt=300)  # learned: chunk steps beside decodes
    for i in range(2):
        sched.add(make_request(f"d{i}", 3, max_tokens=400, ignore_eos=True, arrival_time=20.0 + i))
    fits = []
    monkeypatch.setattr(step_cost, "_nonnegative_fit", lambda rows: fits.append(len(rows)) or (0.01, 1e-3, 0, 0))
    steps = []
    for _ in range(40):
        out = sched.schedule()
        steps.append((StepWork.of_output(out).has_chunk, sched.last_step_estimate, sched.last_step_limit))
        sched.observe_step(out, true_step_seconds(out, 5e-6))
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.samples})
    decode_only = [s for s in steps[2:] if not s[0]]  # after the two prompts' first chunks
    assert len(decode_only) == 38 and all(estimate is None and limit > 0 for _, estimate, limit in decode_only)
    assert len(fits) <= 2  # the prompts' chunks, not one per step
