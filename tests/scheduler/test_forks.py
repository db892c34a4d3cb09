"""Parallel sampling in the scheduler: children fork from their parent's computed prompt (shared full
blocks, a copied partial block), hold their seats, survive their siblings' ends, and free everything."""

from __future__ import annotations

import pytest

from scheduler import InvalidParamsError, RequestStatus
from scheduler.errors import DuplicateRequestError
from tests.scheduler.drive import make_request, make_scheduler, run_until_done, sample_all, step

PROMPT = list(range(100, 110))  # 10 tokens: blocks of 4 -> 2 full blocks and a partial one


def group(n: int, max_tokens: int = 4, prompt=PROMPT, **kw):
    parent = make_request("p", list(prompt), max_tokens=max_tokens, **kw)
    children = [make_request(f"p-{i}", list(prompt), max_tokens=max_tokens, **kw) for i in range(1, n)]
    return parent, children


@pytest.mark.parametrize("caching", [True, False])
def test_children_share_the_prompt_blocks_and_copy_the_partial_one(caching):
    sched = make_scheduler(num_blocks=32, enable_prefix_caching=caching)
    parent, children = group(3)
    sched.add(parent, forks=children)
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["p"] and out.scheduled[0].samples
    assert out.block_copies == ()
    assert sched.num_running == 3 and sched.num_waiting == 0  # forked in update()
    kv = sched.kv_cache_manager
    table = kv.block_table("p")
    for child in children:
        assert kv.block_table(child.request_id)[:2] == table[:2]  # the full blocks, shared
        assert child.num_computed_tokens == 9
    assert [kv.pool.blocks[b].ref_cnt for b in table] == [3, 3, 1]
    assert kv.num_free_blocks == 32 - 5  # 3 blocks + 2 copies, where 3 separate requests hold 9
    out, _ = step(sched)
    assert [src for src, _ in out.block_copies] == [table[2], table[2]]
    assert {dst for _, dst in out.block_copies} == {kv.block_table(c.request_id)[2] for c in children}
    by_id = {s.request_id: s for s in out.scheduled}
    assert by_id["p"].start_position == 10 and by_id["p"].token_ids == (7,)
    for child in children:  # each recomputes the last prompt token and samples its first one
        s = by_id[child.request_id]
        assert (s.start_position, s.token_ids, s.samples) == (9, (109,), True)
    assert step(sched)[0].block_copies == ()  # copies run once
    run_until_done(sched)
    assert kv.num_free_blocks == 32
    sched.check_integrity()


def test_each_sequence_gets_its_own_tokens():
    sched = make_scheduler(num_blocks=32)
    parent, children = group(3, max_tokens=3)
    sched.add(parent, forks=children)
    tokens = {"p": 1, "p-1": 2, "p-2": 3}
    history = run_until_done(sched, token=lambda rid: tokens[rid])
    assert parent.output_token_ids == (1, 1, 1)
    assert [c.output_token_ids for c in children] == [(2, 2, 2), (3, 3, 3)]
    reasons = {e.request_id: e.finish_reason for _, events in history for e in events if e.finished}
    assert reasons == {"p": "length", "p-1": "length", "p-2": "length"}


def test_children_fork_only_after_the_last_prompt_chunk():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=4, max_num_seqs=4)
    parent, children = group(2)
    sched.add(parent, forks=children)
    for _ in range(2):  # chunks [0, 4) and [4, 8): no sample, no fork
        out, _ = step(sched)
        assert [s.request_id for s in out.scheduled] == ["p"] and not out.scheduled[0].samples
        assert sched.num_running == 1 and sched.num_waiting == 1
    step(sched)  # [8, 10) samples: the child forks
    assert sched.num_running == 2 and children[0].num_computed_tokens == 9
    run_until_done(sched)
    assert sched.kv_cache_manager.num_free_blocks == 32


def test_a_parent_that_ends_at_its_first_token_still_forks():
    sched = make_scheduler(num_blocks=32)
    parent, children = group(3, max_tokens=1)
    sched.add(parent, forks=children)
    _, events = step(sched)
    assert [(e.request_id, e.finish_reason) for e in events] == [("p", "length")]
    assert sched.num_running == 2
    _, events = step(sched)
    assert sorted(e.request_id for e in events if e.finished) == ["p-1", "p-2"]
    assert sched.kv_cache_manager.num_free_blocks == 32


def test_aborting_one_child_leaves_the_others():
    sched = make_scheduler(num_blocks=32)
    parent, children = group(3, max_tokens=5)
    sched.add(parent, forks=children)
    step(sched)
    step(sched)
    sched.finish("p-1", RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    history = run_until_done(sched)
    finished = {e.request_id for _, events in history for e in events if e.finished}
    assert finished == {"p", "p-2"}
    assert parent.num_output_tokens == 5 and children[1].num_output_tokens == 5
    assert sched.kv_cache_manager.num_free_blocks == 32


def test_aborting_a_waiting_child_before_the_fork():
    sched = make_scheduler(num_blocks=32)
    parent, children = group(3)
    sched.add(parent, forks=children)
    sched.finish("p-2", RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    step(sched)
    assert sched.num_running == 2
    run_until_done(sched)
    assert children[1].num_output_tokens == 0


@pytest.mark.parametrize("caching", [True, False])
def test_children_of_a_parent_that_fails_compute_their_prompt_themselves(caching):
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=4, enable_prefix_caching=caching)
    parent, children = group(3)
    sched.add(parent, forks=children)
    step(sched)  # the first chunk
    sched.finish("p", RequestStatus.FINISHED_ERROR)
    sched.check_integrity()
    assert sched.num_waiting == 2
    history = run_until_done(sched)
    assert all(c.num_output_tokens == 4 for c in children)
    computed = sum(len(s.token_ids) for out, _ in history for s in out.scheduled)
    assert computed >= 2 * len(PROMPT) - (8 if caching else 0)  # no fork: each prompt is computed
    assert sched.kv_cache_manager.num_free_blocks == 32


def test_a_child_without_a_block_for_its_copy_computes_its_prompt():
    sched = make_scheduler(num_blocks=4, max_num_seqs=4)  # the parent takes 3 of 4 blocks
    parent, children = group(3, max_tokens=2)
    sched.add(parent, forks=children)
    step(sched)
    assert sched.num_running == 2 and sched.num_waiting == 1  # one copy fitted, the other did not
    run_until_done(sched)
    assert all(c.num_output_tokens == 2 for c in children)
    assert sched.kv_cache_manager.num_free_blocks == 4


def test_a_group_waits_for_seats_for_all_its_sequences():
    sched = make_scheduler(num_blocks=64, max_num_seqs=4)
    for rid in ("a", "b"):
        sched.add(make_request(rid, 5, max_tokens=3))
    step(sched)
    parent, children = group(3)
    sched.add(parent, forks=children)
    out, _ = step(sched)
    assert "p" not in {s.request_id for s in out.scheduled}  # 2 running + 3 > 4 seats
    other = make_request("late", 5, max_tokens=3, arrival_time=1.0)
    sched.add(other)
    history = run_until_done(sched)
    first_step: dict[str, int] = {}
    for i, (out, _) in enumerate(history):
        for s in out.scheduled:
            first_step.setdefault(s.request_id, i)
    assert first_step["late"] >= first_step["p"]  # the group is the head: nobody overtakes it
    assert max(len(out.scheduled) for out, _ in history) <= 4


def test_seats_are_held_while_the_parent_computes_its_prompt():
    sched = make_scheduler(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=4)
    parent, children = group(3)
    sched.add(parent, forks=children)
    step(sched)  # the parent runs its first chunk; its children hold 2 more seats
    sched.add(make_request("x", 2, arrival_time=1.0))
    out, _ = step(sched)
    assert "x" not in {s.request_id for s in out.scheduled}
    run_until_done(sched)


def test_add_checks_the_group():
    sched = make_scheduler(max_num_seqs=4)
    parent, _ = group(1)
    with pytest.raises(InvalidParamsError, match="must have the prompt of 'p'"):
        sched.add(parent, forks=[make_request("c", [1, 2, 3])])
    with pytest.raises(InvalidParamsError, match="5 sequences, but at most max_num_seqs"):
        sched.add(*group(5))
    with pytest.raises(DuplicateRequestError):
        sched.add(parent, forks=[make_request("p", list(PROMPT))])
    assert not sched.has_unfinished_requests()
    sched.check_integrity()


def test_preempting_a_forked_child_recomputes_it_alone():
    sched = make_scheduler(num_blocks=6, max_num_seqs=4)
    parent, children = group(2, max_tokens=12)
    sched.add(parent, forks=children)
    history = run_until_done(sched)
    assert sched.num_preemptions >= 1
    assert parent.num_output_tokens == 12 and children[0].num_output_tokens == 12
    assert sched.kv_cache_manager.num_free_blocks == 6
    assert sample_all(history[-1][0])
