"""Speculative steps in the scheduler: drafts scheduled with the last token, charged to the budget,
accepted runs appended in order with stops checked token by token, rejected drafts rolled back,
and blocks holding unverified tokens never hashed."""

from __future__ import annotations

from tests.scheduler.drive import make_request, make_scheduler, step


def prefill(sched, rid="a", prompt=6, **kw):
    sched.add(make_request(rid, prompt, **kw))
    out, events = step(sched, 50)  # the prompt, then the first sampled token 50
    assert events[0].new_token_ids == (50,)
    return sched.get_request(rid)


def propose(sched, req, drafts):
    sched.update_draft_token_ids({req.request_id: drafts})


def test_all_drafts_accepted_plus_the_bonus_token():
    sched = make_scheduler(block_size=4)
    req = prefill(sched, max_tokens=10)
    propose(sched, req, [60, 61, 62])
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.token_ids, s.draft_token_ids, s.num_draft_tokens, s.start_position) == ((50,), (60, 61, 62), 3, 6)
    assert out.num_batched_tokens == 4 and len(s.block_table) * 4 >= 6 + 4
    (event,) = sched.update(out, {"a": [60, 61, 62, 63]})
    assert event.new_token_ids == (60, 61, 62, 63) and event.finish_reason is None
    assert req.num_computed_tokens == 10 and req.num_tokens == 11  # 63 is the new last, uncomputed
    sched.check_integrity()


def test_rejected_drafts_roll_back():
    sched = make_scheduler(block_size=4)
    req = prefill(sched, max_tokens=10)
    propose(sched, req, [60, 61, 62])
    out = sched.schedule()
    (event,) = sched.update(out, {"a": [60, 99]})  # one accepted, the target's 99 instead of 61
    assert event.new_token_ids == (60, 99) and req.num_computed_tokens == 8 and req.num_tokens == 9
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.token_ids, s.start_position, s.num_draft_tokens) == ((99,), 8, 0)  # rewrites slot 8
    sched.update(out, {"a": 5})
    sched.check_integrity()


def test_a_stop_inside_the_accepted_run_ends_the_request_there():
    sched = make_scheduler(block_size=4)
    req = prefill(sched, max_tokens=10, eos_token_ids=(61,))
    propose(sched, req, [60, 61, 62])
    out = sched.schedule()
    (event,) = sched.update(out, {"a": [60, 61, 62, 63]})
    assert event.new_token_ids == (60, 61) and event.finish_reason == "stop" and event.stop_token_id == 61
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
    sched.check_integrity()


def test_max_tokens_inside_the_accepted_run_ends_it_with_length():
    sched = make_scheduler(block_size=4)
    req = prefill(sched, max_tokens=3)
    propose(sched, req, [60, 61])
    out = sched.schedule()
    (event,) = sched.update(out, {"a": [60, 61, 62]})
    assert event.new_token_ids == (60, 61) and event.finish_reason == "length"


def test_drafts_are_charged_to_the_budget_or_dropped():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    a = prefill(sched, "a", 3, max_tokens=20)
    b = prefill(sched, "b", 3, max_tokens=20)
    propose(sched, a, [1, 2, 3, 4, 5, 6])  # 7 tokens: fits
    propose(sched, b, [1, 2, 3])  # 4 more would exceed 8: scheduled as a plain decode
    out = sched.schedule()
    assert [(s.request_id, s.num_draft_tokens) for s in out.scheduled] == [("a", 6), ("b", 0)]
    assert out.num_batched_tokens == 8
    sched.update(out, {"a": [1, 9], "b": 7})
    sched.check_integrity()


def test_blocks_holding_unverified_tokens_are_never_hashed():
    sched = make_scheduler(block_size=4)
    req = prefill(sched, prompt=3, max_tokens=20)  # 3 prompt tokens + 50: a block of 4 known tokens
    propose(sched, req, [60, 61, 62, 63, 64])  # positions 4..8: would fill block 1 with drafts
    out = sched.schedule()
    kv = sched.kv_cache_manager
    table = out.scheduled[0].block_table
    assert kv.pool.blocks[table[1]].block_hash is None  # only drafts in it so far
    sched.update(out, {"a": [60, 70]})  # 60 accepted, 70 instead of 61: block 1 holds 60 70 ...
    out = sched.schedule()
    sched.update(out, {"a": 71})
    assert kv.pool.blocks[table[1]].block_hash is None or req.num_computed_tokens >= 8
    sched.check_integrity()


def test_preemption_drops_the_drafts_and_frees_everything():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    a = prefill(sched, "a", 6, max_tokens=6)
    b = prefill(sched, "b", 6, max_tokens=6)
    propose(sched, a, [1, 2, 3])
    propose(sched, b, [4, 5, 6])
    out = sched.schedule()  # not enough blocks for both with drafts: drafts dropped, maybe preemption
    sampled = {s.request_id: [9] * (s.num_draft_tokens + 1) if s.num_draft_tokens else 9
               for s in out.scheduled if s.samples}
    sched.update(out, sampled)
    sched.check_integrity()
    while sched.has_unfinished_requests():
        step(sched, 9)
    assert sched.kv_cache_manager.num_free_blocks == 4


def test_drafts_live_for_one_step_only():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    a = prefill(sched, "a", 3, max_tokens=20)
    propose(sched, a, list(range(1, 10)))  # 10 tokens do not fit the budget of 8: a plain decode
    out = sched.schedule()
    assert [(s.request_id, s.num_draft_tokens) for s in out.scheduled] == [("a", 0)]
    sched.update(out, {"a": 7})
    out = sched.schedule()  # nothing proposed since: no drafts, although they would fit now
    assert [(s.request_id, s.num_draft_tokens, s.draft_token_ids) for s in out.scheduled] == [("a", 0, ())]
    sched.update(out, {"a": 8})
    sched.check_integrity()


def test_drafts_for_a_request_that_is_not_decoding_are_ignored():
    sched = make_scheduler(block_size=4)
    sched.add(make_request("w", 6, max_tokens=5))
    sched.update_draft_token_ids({"w": [1, 2], "unknown": 3})
    out = sched.schedule()  # "w" is admitted with its prompt: no drafts for a prefill
    assert [(s.request_id, s.num_draft_tokens) for s in out.scheduled] == [("w", 0)]
    sched.update(out, {"w": 9})
    sched.check_integrity()
