"""Speculator: it proposes drafts for the scheduler (Scheduler.update_draft_token_ids) and never
writes the scheduler's requests; the scheduler schedules them for one step."""

from __future__ import annotations

from metrale.sampling_params import SamplingParams
from metrale.speculative.config import SpeculativeConfig
from metrale.speculative.speculator import Speculator
from tests.scheduler.drive import make_request, make_scheduler, step

PARAMS = SamplingParams(max_tokens=20, temperature=0)


class Repeat:
    """A host proposer that drafts the last token k times."""

    def propose(self, request_id, token_ids, k):
        return [token_ids[-1]] * k

    def forget(self, request_id):
        pass


def decoding_scheduler():
    sched = make_scheduler(block_size=4)
    sched.add(make_request("a", 5, max_tokens=20))
    step(sched, 50)  # the prompt, then the first token: "a" decodes from now on
    return sched


def test_drafts_go_to_the_scheduler_and_not_onto_the_request():
    sched = decoding_scheduler()
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3), Repeat())
    request = sched.get_request("a")
    before = {name: getattr(request, name) for name in request.__slots__ if name != "_all_token_ids"}
    drafts = speculator.propose(sched.running, lambda request_id: PARAMS)
    assert drafts == {"a": (50, 50, 50)}
    assert {name: getattr(request, name) for name in before} == before
    sched.update_draft_token_ids(drafts)
    out = sched.schedule()
    assert [(s.request_id, s.draft_token_ids) for s in out.scheduled] == [("a", (50, 50, 50))]
    sched.update(out, {"a": [50, 7]})
    assert speculator.record(out, {"a": (50, 7)}).num_accepted == 1
    sched.check_integrity()


def test_the_runner_proposer_gets_a_count():
    sched = decoding_scheduler()
    speculator = Speculator(SpeculativeConfig(method="draft_model", model="unused", num_speculative_tokens=2))
    assert speculator.propose(sched.running, lambda request_id: PARAMS) == {"a": 2}
