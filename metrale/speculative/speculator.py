"""Speculator: the engine core's side of speculation, on the event loop.

Before a step it gives each running request that may speculate its drafts (host proposer) or its
draft count (the runner proposes); after the step it records how many were accepted, per request
(the adaptive policy) and per draft position (the metrics).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from metrale.sampling_params import SamplingParams
from metrale.speculative.config import SpeculativeConfig
from metrale.speculative.policy import SpeculationPolicy
from metrale.speculative.proposers import HostProposer, NgramProposer
from scheduler import Request, SchedulerOutput


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

    @property
    def runner_proposes(self) -> bool:
        return self.proposer is None

    def propose(self, running: Sequence[Request], params_of: Callable[[str], SamplingParams]) -> None:
        """Set each decoding request's drafts (or draft count) for the next step."""
        num_running = len(running)
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1:
                continue  # still prefilling
            k = self.policy.num_drafts(request.request_id, params_of(request.request_id),
                                       request.num_output_tokens, request.max_tokens, num_running)
            if not k:
                continue
            if self.proposer is None:
                request.spec_token_ids, request.num_spec_tokens = (), k
                continue
            drafts = tuple(self.proposer.propose(request.request_id, request.all_token_ids, k))
            request.spec_token_ids, request.num_spec_tokens = drafts, len(drafts)

    def record(self, output: SchedulerOutput, sampled: Mapping[str, int | list[int]]) -> Verification:
        """What this step's verifications accepted (before any stop cut a run short)."""
        result = Verification()
        for s in output.scheduled:
            run = sampled.get(s.request_id)
            if not s.num_draft_tokens or not isinstance(run, list):
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
