"""Scheduler: budget, chunked prefill, finishing, admission control, preemption, prefix reuse."""

import pytest

from kvcache.manager import KVCacheManager
from scheduler import (
    DuplicateRequestError,
    LoraRef,
    QueueFullError,
    RequestRejectedError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
)
from tests.scheduler.drive import (
    finish_reasons,
    make_request,
    make_scheduler,
    run_until_done,
    sample_all,
    step,
)


def test_chunked_prefill_then_decode_until_length():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    sched.add(make_request("a", 19, max_tokens=3))
    outs = []
    for _ in range(5):
        out, events = step(sched)
        outs.append((out.scheduled[0], events))
    chunks = [(s.start_position, len(s.token_ids), s.samples) for s, _ in outs]
    assert chunks == [(0, 8, False), (8, 8, False), (16, 3, True), (19, 1, True), (20, 1, True)]
    assert [len(s.block_table) for s, _ in outs] == [2, 4, 5, 5, 6]
    assert outs[0][1] == [] and outs[2][1][0].new_token_ids == (7,)
    assert outs[3][0].token_ids == (7,)  # the sampled token is fed back
    assert outs[4][1][0].finish_reason == "length"
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 32


def test_output_is_frozen_plain_values():
    sched = make_scheduler()
    sched.add(make_request("a", 5))
    out = sched.schedule()
    assert out.block_size == 4 and out.num_batched_tokens == 5 and out.preempted_request_ids == ()
    with pytest.raises(AttributeError):
        out.num_batched_tokens = 3
    with pytest.raises(AttributeError):
        out.scheduled[0].samples = False


def test_running_first_then_admission_within_budget_and_max_num_seqs():
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    sched.add(make_request("a", 6))
    sched.add(make_request("b", 6))
    sched.add(make_request("c", 2))
    out, _ = step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 6), ("b", 4)]
    out, _ = step(sched)  # a decodes first, b finishes its prompt; c waits for a seat
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 2)]
    assert sched.num_running == 2 and sched.num_waiting == 1
    for out, _ in run_until_done(sched):
        assert out.num_batched_tokens <= 10 and len(out.scheduled) <= 2


@pytest.mark.parametrize(
    ("kw", "tokens", "reason", "n_out", "stop_id"),
    [
        ({"eos_token_ids": (2,)}, [5, 2], "stop", 2, 2),
        ({"eos_token_ids": (2, 3)}, [3], "stop", 1, 3),
        ({"eos_token_ids": (2,), "ignore_eos": True}, [2, 2, 2, 2], "length", 4, None),
        ({"stop_token_ids": (9,)}, [9], "stop", 1, 9),
        ({"stop_token_ids": (9,), "ignore_eos": True}, [9], "stop", 1, 9),
        ({"eos_token_ids": (2,), "min_tokens": 3}, [2, 2, 2], "stop", 3, 2),
        ({"stop_token_ids": (9,), "min_tokens": 2}, [9, 5, 9], "stop", 3, 9),
        ({"eos_token_ids": (2,)}, [5, 5, 5, 2], "stop", 4, 2),  # stop wins over length
        ({"eos_token_ids": (2,)}, [5, 5, 5, 5], "length", 4, None),
    ],
)
def test_finish_conditions(kw, tokens, reason, n_out, stop_id):
    sched = make_scheduler()
    sched.add(make_request("a", 3, max_tokens=4, **kw))
    req = sched.get_request("a")
    feed = iter(tokens)
    history = run_until_done(sched, token=lambda rid: next(feed))
    last = history[-1][1][-1]
    assert (last.finish_reason, last.stop_token_id) == (reason, stop_id)
    assert req.num_output_tokens == n_out and req.output_token_ids == tuple(tokens[:n_out])
    assert req.status.finish_reason == reason and req.is_finished


def test_add_rejections_name_the_numbers_and_change_nothing():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=32, max_waiting=2)
    sched.add(make_request("a", 3))
    cases = [
        (make_request("a", 3), DuplicateRequestError, "'a' is already in flight"),
        (make_request("e", []), RequestRejectedError, r"prompt is empty \(0 tokens\)"),
        (make_request("l", 30, max_tokens=5), RequestRejectedError,
         r"prompt \(30 tokens\) \+ max_tokens \(5\) = 35 exceeds max_model_len \(32\)"),
        (make_request("p", 15, max_tokens=3), RequestRejectedError,
         r"needs 5 KV blocks of 4 tokens for 17 tokens, but the whole pool has 4"),
        (make_request("m", 3, max_tokens=0), RequestRejectedError, "max_tokens must be an int"),
        (make_request("q", 3, priority=0.5), RequestRejectedError, "priority must be an int"),
        (make_request("n", 3, max_tokens=2, min_tokens=3), RequestRejectedError,
         r"min_tokens must be in 0..max_tokens \(2\), got 3"),
        (make_request("g", [1, -4]), RequestRejectedError, r"negative token id \(-4\)"),
    ]
    for request, error, message in cases:
        with pytest.raises(error, match=message):
            sched.add(request)
        assert sched.num_waiting == 1 and sched.get_request(request.request_id) is not request
    assert issubclass(DuplicateRequestError, RequestRejectedError)
    assert issubclass(RequestRejectedError, ValueError)
    sched.add(make_request("b", 13, max_tokens=4))  # 16 tokens of KV at most: exactly 4 blocks
    with pytest.raises(QueueFullError, match=r"full \(2 of 2 requests\)"):
        sched.add(make_request("c", 3))
    assert sched.num_waiting == 2 and sched.get_request("c") is None
    sched.check_integrity()


def test_finished_id_can_be_reused_and_used_request_object_is_rejected():
    sched = make_scheduler()
    req = make_request("a", 3, max_tokens=1)
    sched.add(req)
    run_until_done(sched)
    with pytest.raises(RequestRejectedError, match="already scheduled"):
        sched.add(req)
    sched.add(make_request("a", 3, max_tokens=1))
    assert finish_reasons(run_until_done(sched)) == {"a": "length"}


def test_finish_is_idempotent_and_frees_blocks():
    sched = make_scheduler(num_blocks=8)
    sched.add(make_request("run", 6))
    sched.add(make_request("wait", 6))
    sched2_free = sched.kv_cache_manager.num_free_blocks
    step(sched)
    assert sched.kv_cache_manager.num_free_blocks < sched2_free
    ev = sched.finish("run", RequestStatus.FINISHED_ABORTED)
    assert (ev.request_id, ev.new_token_ids, ev.finish_reason) == ("run", (), "abort")
    assert sched.finish("run", RequestStatus.FINISHED_ABORTED) is None
    assert sched.finish("never", RequestStatus.FINISHED_ERROR) is None
    assert sched.finish("wait", RequestStatus.FINISHED_ABORTED).finish_reason == "abort"
    assert sched.kv_cache_manager.num_free_blocks == 8 and not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="finished RequestStatus"):
        sched.finish("x", RequestStatus.RUNNING)
    sched.check_integrity()


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    sched.add(make_request("a", 3))
    sched.add(make_request("b", 3))
    out = sched.schedule()
    sched.finish("a", RequestStatus.FINISHED_ABORTED)
    sched.add(make_request("a", 3))  # same id, new request, added mid-step: not touched either
    events = sched.update(out, sample_all(out))
    assert [e.request_id for e in events] == ["b"]
    assert sched.get_request("a").num_output_tokens == 0
    assert sched.get_request("a").status is RequestStatus.WAITING
    sched.check_integrity()


def test_update_validates_before_changing_anything():
    sched = make_scheduler()
    sched.add(make_request("a", 3))
    sched.add(make_request("b", 3))
    out = sched.schedule()
    with pytest.raises(ValueError, match=r"no sampled token for 1 requests: \['b'\]"):
        sched.update(out, {"a": 5})
    assert sched.get_request("a").num_output_tokens == 0
    sched.update(out, {"a": 5, "b": 6, "stranger": 1})
    with pytest.raises(RuntimeError, match="stale output"):
        sched.update(out, {"a": 5, "b": 6})


def test_prefix_shared_by_two_requests_is_computed_once():
    sched = make_scheduler(block_size=4)
    prefix = list(range(100, 112))  # 3 blocks
    sched.add(make_request("a", prefix + [1, 2], max_tokens=2))
    step(sched)
    table_a = sched.kv_cache_manager.block_table("a")
    sched.add(make_request("b", prefix + [3, 4, 5], max_tokens=2))
    out, _ = step(sched)
    (b,) = [s for s in out.scheduled if s.request_id == "b"]
    assert (b.start_position, b.token_ids) == (12, (3, 4, 5))
    assert b.block_table[:3] == tuple(table_a[:3])
    kv = sched.kv_cache_manager
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (14 + 15, 12)
    run_until_done(sched)


def test_preemption_victim_is_latest_arrival_and_keeps_its_output():
    # 4 blocks of 2: a and b (prompt 3 each) each hold 2 blocks after their prompt.
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=8)
    sched.add(make_request("a", [1, 2, 3], max_tokens=4, arrival_time=1.0))
    sched.add(make_request("b", [4, 5, 6], max_tokens=4, arrival_time=2.0))
    step(sched)  # both prefill and sample: 4 tokens each now, the 4th needs no block yet
    step(sched)  # both decode position 3 and sample: position 4 needs a 3rd block each
    out, _ = step(sched)
    assert out.preempted_request_ids == ("b",) and [s.request_id for s in out.scheduled] == ["a"]
    b = sched.get_request("b")
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.output_token_ids == (7, 7)
    history = run_until_done(sched)
    first_b = next(s for out, _ in history for s in out.scheduled if s.request_id == "b")
    # Recompute covers prompt + output; the prefix cache gave back b's first full block.
    assert first_b.start_position == 2 and first_b.token_ids == (6, 7, 7)
    assert finish_reasons(history) == {"a": "length", "b": "length"}
    assert b.output_token_ids == (7, 7, 7, 7)


def test_request_that_needs_room_and_is_the_victim_is_skipped():
    sched = make_scheduler(num_blocks=3, block_size=2, max_num_batched_tokens=8)
    sched.add(make_request("old", [1, 2, 3], max_tokens=3, arrival_time=1.0))
    sched.add(make_request("new", [4, 5], max_tokens=4, arrival_time=2.0))
    step(sched)  # old holds 2 blocks, new 1: the pool is full
    out, _ = step(sched)  # old decodes position 3 in place; new needs a block for position 2
    assert out.preempted_request_ids == ("new",)
    assert [s.request_id for s in out.scheduled] == ["old"]
    assert sched.get_request("new").status is RequestStatus.PREEMPTED
    assert finish_reasons(run_until_done(sched)) == {"old": "length", "new": "length"}


def test_priority_policy_preempts_lowest_priority_even_if_admitted_first():
    sched = make_scheduler(num_blocks=3, block_size=2, max_num_batched_tokens=8, policy="priority")
    # "low" (larger value = lower priority) arrives and is admitted first.
    sched.add(make_request("low", [1, 2], max_tokens=4, priority=5, arrival_time=1.0))
    step(sched)
    sched.add(make_request("high", [50, 51], max_tokens=4, priority=0, arrival_time=2.0))
    step(sched)  # low: 2 blocks, high: 1 block; the pool is full
    out, _ = step(sched)
    # high is served first now; it needs a block, low (which needs none) is the victim.
    assert out.preempted_request_ids == ("low",)
    assert [s.request_id for s in out.scheduled] == ["high"] and out.num_batched_tokens == 1
    assert sched.get_request("low").num_output_tokens == 2
    assert finish_reasons(run_until_done(sched)) == {"low": "length", "high": "length"}


def test_priority_policy_admits_lowest_value_first():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    sched.add(make_request("late-urgent", 2, max_tokens=1, priority=-1, arrival_time=5.0))
    sched.add(make_request("early", 2, max_tokens=1, priority=0, arrival_time=1.0))
    sched.add(make_request("earliest-lazy", 2, max_tokens=1, priority=3, arrival_time=0.0))
    order = [out.scheduled[0].request_id for out, _ in run_until_done(sched)]
    assert order == ["late-urgent", "early", "earliest-lazy"]


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=8, policy="priority")
    sched.add(make_request("a", [1, 2, 3], max_tokens=4, arrival_time=1.0))
    sched.add(make_request("b", [4, 5, 6], max_tokens=4, arrival_time=2.0))
    step(sched)
    step(sched)
    sched.add(make_request("c", [9], max_tokens=1, priority=-1, arrival_time=3.0))  # queue head
    out, _ = step(sched)  # a's block came from preempting b; c would fit, but blocks are short
    assert out.preempted_request_ids == ("b",)
    assert [s.request_id for s in out.scheduled] == ["a"]
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "c"]


def test_large_head_request_neither_starves_nor_is_starved():
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    for i in range(4):
        sched.add(make_request(f"s{i}", 5, max_tokens=30, arrival_time=float(i)))
    step(sched)
    sched.add(make_request("big", 100, max_tokens=2, arrival_time=10.0))
    first_token = {}
    for n in range(200):
        if n % 2 == 0 and n < 120:  # small requests keep arriving behind it
            sched.add(make_request(f"late{n}", 5, max_tokens=3, arrival_time=11.0 + n))
        _, events = step(sched)
        for ev in events:
            first_token.setdefault(ev.request_id, n)
        if not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    assert first_token["big"] < 40  # 100 prompt tokens at <= 16 per step, plus sharing
    assert first_token["late0"] < first_token["big"] + 30


def test_scheduler_and_manager_must_agree():
    with pytest.raises(ValueError, match="block_size: config has 16, kv_cache_manager has 8"):
        Scheduler(SchedulerConfig(block_size=16), KVCacheManager(4, 8))
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Scheduler(SchedulerConfig(block_size=8), KVCacheManager(4, 8, enable_prefix_caching=False))


def test_error_finish_drops_cached_blocks():
    sched = make_scheduler(block_size=2)
    sched.add(make_request("a", [1, 2, 3, 4, 5], max_tokens=3))
    step(sched)
    sched.finish("a", RequestStatus.FINISHED_ERROR)
    assert sched.kv_cache_manager.pool.cached_blocks == {}
    sched.add(make_request("b", [1, 2, 3, 4, 5], max_tokens=3))
    out, _ = step(sched)
    assert out.scheduled[0].start_position == 0


def test_prefix_caching_disabled_end_to_end():
    sched = make_scheduler(enable_prefix_caching=False)
    sched.add(make_request("a", list(range(9)), max_tokens=2))
    step(sched)
    sched.add(make_request("b", list(range(9)), max_tokens=2))
    out, _ = step(sched)
    assert [s.start_position for s in out.scheduled if s.request_id == "b"] == [0]
    run_until_done(sched)


def test_each_block_is_hashed_once_over_a_request_life(monkeypatch):
    import kvcache.hashing

    calls = []
    real = kvcache.hashing.hash_block_tokens
    monkeypatch.setattr(
        kvcache.hashing, "hash_block_tokens", lambda *a: calls.append(a) or real(*a)
    )
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    sched.add(make_request("a", 40, max_tokens=20))
    run_until_done(sched)
    assert len(calls) == (40 + 20 - 1) // 4  # every block that ever filled, hashed once


def test_same_prompt_under_another_lora_adapter_shares_no_blocks():
    sched = make_scheduler(block_size=4)
    prompt = list(range(100, 112))  # 3 blocks
    adapter = LoraRef("A", "/adapters/a")
    sched.add(make_request("base", prompt + [1], max_tokens=2))
    step(sched)
    sched.add(make_request("a", prompt + [1], max_tokens=2, lora=adapter))
    sched.add(make_request("a2", prompt + [1], max_tokens=2, lora=adapter))
    out, _ = step(sched)
    tables = {s.request_id: s.block_table for s in out.scheduled}
    assert not set(tables["a"]) & set(sched.kv_cache_manager.block_table("base"))
    assert [s.lora for s in out.scheduled if s.request_id != "base"] == [adapter, adapter]
    run_until_done(sched)
    sched.add(make_request("a3", prompt + [2], max_tokens=2, lora=adapter))
    out, _ = step(sched)
    assert out.scheduled[0].start_position == 12  # A's own blocks are reused
    run_until_done(sched)
    sched.check_integrity()


def test_at_most_max_loras_adapters_run_at_once():
    sched = make_scheduler(max_loras=2, max_num_seqs=8)
    refs = [LoraRef(name, f"/adapters/{name}") for name in "ABC"]
    for rid, ref in [("a", refs[0]), ("b", refs[1]), ("base", None), ("c", refs[2]), ("a2", refs[0])]:
        sched.add(make_request(rid, 3, max_tokens=2, lora=ref))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b", "base"]  # c waits at the head, a2 behind it
    while {r.request_id for r in sched.running} & {"a", "b"}:
        out, _ = step(sched)
    out, _ = step(sched)
    assert {s.request_id for s in out.scheduled} >= {"c", "a2"}
    run_until_done(sched)
    sched.check_integrity()
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(max_loras=0)
