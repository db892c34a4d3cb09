"""Request and RequestStatus: token bookkeeping and finish reasons."""

import pytest

from scheduler import FinishReason, Request, RequestStatus


def test_token_views_and_counts():
    r = Request("a", [1, 2, 3], max_tokens=5, eos_token_ids=[2], arrival_time=1.5)
    assert r.prompt_token_ids == (1, 2, 3) and r.eos_token_ids == (2,)
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (3, 3, 0)
    r.append_output_token(9)
    r.append_output_token(8)
    assert list(r.all_token_ids) == [1, 2, 3, 9, 8] and r.output_token_ids == (9, 8)
    assert (r.num_tokens, r.num_output_tokens) == (5, 2)
    assert r.status is RequestStatus.WAITING and not r.is_finished
    assert r.arrival_time == 1.5 and r.num_computed_tokens == 0 and r.num_preemptions == 0


def test_defaults_and_resume_with_outputs():
    r = Request("a", (4, 5), output_token_ids=(6,))
    assert r.max_tokens == 16 and r.cache_salt is None and r.priority == 0
    assert r.output_token_ids == (6,) and r.num_tokens == 3
    assert isinstance(r.arrival_time, float)


def test_token_ids_must_be_ints():
    with pytest.raises(TypeError):
        Request("a", [1.5])


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
        (RequestStatus.FINISHED_ERROR, "error"),
    ],
)
def test_finish_reason_mapping(status, reason):
    assert status.is_finished and status.finish_reason == reason and status.finish_reason is FinishReason(reason)
    assert RequestStatus.finished_with(FinishReason(reason)) is status


def test_unfinished_statuses_have_no_reason():
    for status in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED):
        assert not status.is_finished and status.finish_reason is None
    with pytest.raises(ValueError, match="'eos' is not a valid FinishReason"):
        RequestStatus.finished_with("eos")
