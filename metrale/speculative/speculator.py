"""Speculator: the engine core's side of speculation, on the event loop.

Before a step it proposes, for each running request that may speculate, its drafts (host proposer)
or its draft count (the runner proposes), which the engine hands to the scheduler
(Scheduler.update_draft_token_ids); after the step it records how many were accepted, per request
(the adaptive policy) and per draft position (the metrics). It reads the scheduler's requests and
never writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from metrale.sampling_params import SamplingParams
from metrale.speculative.config import SpeculativeConfig
from metrale.speculative.policy import SpeculationPolicy
from metrale.speculative.proposers import HostProposer, NgramProposer
from scheduler import Request, SchedulerOutput

Drafts = dict[str, tuple[int, ...] | int]  # request id -> its draft token ids, or how many the runner proposes


@dataclass
class Verification:
    """One step's verifications: drafts proposed and accepted, and acceptances per draft position."""

    num_verified: int = 0  # requests whose drafts were verified
    num_drafts: int = 0
    num_accepted: int = 0
    drafts_per_position: list[int] = field(default_factory=list)  # [i]: drafts proposed at position i
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i


class Speculator:
    """Proposes before `schedule()`, records after `update()`; one per engine."""

    def __init__(self, config: SpeculativeConfig, proposer: HostProposer | None = None) -> None:
        """`proposer` None: with method "ngram" an NgramProposer; with "draft_model" the runner proposes."""
        self.config = config
        if proposer is None and config.method == "ngram":
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.proposer = proposer
        self.policy = SpeculationPolicy(config)

    def propose(self, running: Sequence[Request], params_of: Callable[[str], SamplingParams]) -> Drafts:
        """Each decoding request's drafts (or draft count) for the next step."""
        drafts: Drafts = {}
        num_running = len(running)
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1:
                continue  # still prefilling
            k = self.policy.num_drafts(request.request_id, params_of(request.request_id),
                                       request.num_output_tokens, request.max_tokens, num_running)
            if not k:
                continue
            if self.proposer is None:
                drafts[request.request_id] = k
                continue
            proposed = tuple(self.proposer.propose(request.request_id, request.all_token_ids, k))
            if proposed:
                drafts[request.request_id] = proposed
        return drafts

    def record(self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> Verification:
        """What this step's verifications accepted (before any stop cut a run short). `sampled`: the
        tokens of each request that got some (a failed request has none)."""
        result = Verification()
        for s in output.scheduled:
            run = sampled.get(s.request_id)
            if not s.num_draft_tokens or not run:
                continue
            accepted = len(run) - 1
            self.policy.record(s.request_id, s.num_draft_tokens, accepted)
            result.num_verified += 1
            result.num_drafts += s.num_draft_tokens
            result.num_accepted += accepted
            for counts in (result.drafts_per_position, result.accepted_per_position):
                counts += [0] * (s.num_draft_tokens - len(counts))
            for position in range(s.num_draft_tokens):
                result.drafts_per_position[position] += 1
                result.accepted_per_position[position] += position < accepted
        return result

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
        if self.proposer is not None:
            self.proposer.forget(request_id)
