"""Property scenarios: random traffic through a real Scheduler + KVCacheManager, no model.

Random arrivals, prompt lengths, shared prefixes, output lengths, tiny pools that force
preemption, queue-full retries and aborts at every lifecycle state. After every step the
integrity check holds, the budget and max_num_seqs hold, every scheduled chunk is the request's
true next tokens, and no block that held computed (cached) tokens before the step is written.
With `spec_rate`, decoding requests get random drafts that the made-up runner accepts in part: the
rejected drafts' KV must never be read back as context and never reach the prefix cache.
At the end every request has exactly one finish event and the pool is entirely free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import DuplicateRequestError, QueueFullError, RequestStatus
from tests.scheduler.drive import make_request, make_scheduler

EOS, STOP = 0, 1
ABORT_STATES = ("waiting", "preempted", "prefill", "decode", "final")
MAX_STEPS = 5000


@dataclass
class Spec:
    rid: str
    arrival: int
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    use_stop: bool
    priority: int
    abort: str | None  # one of ABORT_STATES
    abort_midstep: bool  # between schedule() and update() rather than at a step boundary
    salt: str | None = None


@st.composite
def request_specs(draw, index, prefixes, rng_seed: int, abort_rate: float, max_arrival: int):
    rng = random.Random(rng_seed * 1000 + index)
    prefix = prefixes[draw(st.integers(0, len(prefixes) - 1))]
    suffix = [rng.randrange(100, 200) for _ in range(draw(st.integers(0, 10)))]
    prompt = (prefix + suffix) or [rng.randrange(100, 200)]
    max_tokens = draw(st.integers(1, 16))
    abort = draw(st.sampled_from(ABORT_STATES)) if rng.random() < abort_rate else None
    return Spec(
        rid=f"r{index}",
        arrival=draw(st.integers(0, max_arrival)),
        prompt=prompt,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)) if rng.random() < 0.3 else 0,
        ignore_eos=rng.random() < 0.2,
        use_stop=rng.random() < 0.5,
        priority=draw(st.integers(0, 2)),
        abort=abort,
        abort_midstep=abort == "final" or draw(st.booleans()),
        salt=draw(st.sampled_from([None, None, "tenant-a", "tenant-b"])),
    )


@st.composite
def scenarios(draw, abort_rate=0.35, pool_slack=12, requests=(1, 12), max_arrival=20):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = random.Random(seed)
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 6))
    prefixes = [[rng.randrange(100, 110) for _ in range(n)]  # small vocab: partial overlaps too
                for n in draw(st.lists(st.integers(0, 20), min_size=1, max_size=3))]
    n = draw(st.integers(*requests))
    specs = [draw(request_specs(i, prefixes, seed, abort_rate, max_arrival)) for i in range(n)]
    longest = max(len(s.prompt) + s.max_tokens for s in specs)
    most_blocks = max(-(-(len(s.prompt) + s.max_tokens - 1) // block_size) for s in specs)
    config = dict(
        block_size=block_size,
        num_blocks=most_blocks + draw(st.integers(0, pool_slack)),  # +0: one request fills it
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 48)),
        max_model_len=longest + draw(st.integers(0, 3)),
        max_waiting=draw(st.integers(1, 12)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
    )
    eos_rate = draw(st.sampled_from([0.0, 0.05, 0.15]))
    spec_rate = draw(st.sampled_from([0.0, 0.0, 0.5]))
    return config, specs, seed, eos_rate, spec_rate


class Driver:
    """Runs one scenario, checking every step; records each request's tokens and finish."""

    def __init__(self, config: dict, specs: list[Spec], seed: int, eos_rate: float, spec_rate: float = 0.0) -> None:
        self.sched = make_scheduler(**config)
        self.cfg = self.sched.config
        self.kv = self.sched.kv_cache_manager
        self.specs = {s.rid: s for s in specs}
        self.pending = sorted(specs, key=lambda s: (s.arrival, s.rid))
        self.rng = random.Random(seed)
        self.eos_rate = eos_rate
        self.spec_rate = spec_rate
        self.accepted: dict[str, tuple] = {}  # rid -> (its ScheduledRequest, drafts accepted), this step
        self.pre_step_hashes: dict[int, bytes] = {}  # block id -> hash, before this step
        self.fresh: set[int] = set()  # blocks handed out by the pool during this step
        allocate = self.kv.pool.allocate

        def tracking_allocate(num_blocks):
            blocks = allocate(num_blocks)
            self.fresh.update(b.block_id for b in blocks)
            return blocks

        self.kv.pool.allocate = tracking_allocate
        self.tokens: dict[str, list[int]] = {}  # the true sequence: prompt + sampled so far
        self.requests = {}  # rid -> the Request object that was accepted
        # The made-up runner's KV pool: slot -> (fingerprint of the tokens up to that position,
        # salt). A request's context must read back its own fingerprints and salt.
        self.kv_slots: dict[int, tuple[int, str | None]] = {}
        self.fingerprints: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}  # rid -> finish reason, from exactly one event
        self.aborted: dict[str, str] = {}  # rid -> the state it was aborted in
        self.step_no = 0

    def run(self) -> None:
        while self.pending or self.sched.has_unfinished_requests():
            if self.step_no >= MAX_STEPS:
                raise AssertionError(f"no progress: {self.sched.num_running} running, "
                                     f"{self.sched.num_waiting} waiting after {MAX_STEPS} steps")
            self.arrive()
            self.abort_matching(midstep=False, out=None)
            self.propose_drafts()
            out = self.sched.schedule()
            self.check_output(out)
            self.abort_matching(midstep=True, out=out)
            sampled = {s.request_id: self.verify(s) for s in out.scheduled if s.samples}
            self.record(self.sched.update(out, sampled), sampled)
            self.accepted.clear()
            self.sched.check_integrity()
            self.step_no += 1
        self.check_end()

    def arrive(self) -> None:
        while self.pending and self.pending[0].arrival <= self.step_no:
            s = self.pending[0]
            req = make_request(
                s.rid, list(s.prompt), max_tokens=s.max_tokens, min_tokens=s.min_tokens,
                eos_token_ids=(EOS,), stop_token_ids=(STOP,) if s.use_stop else (),
                ignore_eos=s.ignore_eos, priority=s.priority, arrival_time=float(s.arrival),
                cache_salt=s.salt,
            )
            try:
                self.sched.add(req)
            except QueueFullError:
                assert self.sched.num_waiting >= self.cfg.max_waiting
                return  # the client retries next step
            self.pending.pop(0)
            self.tokens[s.rid] = list(s.prompt)
            self.requests[s.rid] = req
            if self.rng.random() < 0.1:  # a duplicate id in flight is rejected, nothing changes
                with pytest.raises(DuplicateRequestError):
                    self.sched.add(make_request(s.rid, [5], max_tokens=1))

    def propose_drafts(self) -> None:
        """Random drafts for some decoding requests, never past their max_tokens."""
        for rid in self.tokens:
            req = self.sched.get_request(rid)
            if req is None or req.status is not RequestStatus.RUNNING or self.rng.random() >= self.spec_rate:
                continue
            room = req.max_tokens - req.num_output_tokens - 1
            if req.num_tokens - req.num_computed_tokens == 1 and room > 0:
                k = self.rng.randint(1, min(room, 5))
                self.sched.update_draft_token_ids({rid: tuple(self.rng.randrange(2, 10) for _ in range(k))})

    def verify(self, scheduled) -> int | list[int]:
        """The made-up runner: a plain sample, or a random prefix of the drafts plus its own token."""
        if not scheduled.num_draft_tokens:
            return self.sample()
        accepted = self.rng.randint(0, scheduled.num_draft_tokens)
        self.accepted[scheduled.request_id] = (scheduled, accepted)
        return [*scheduled.draft_token_ids[:accepted], self.sample()]

    def sample(self) -> int:
        x = self.rng.random()
        if x < self.eos_rate:
            return EOS
        return STOP if x < 1.5 * self.eos_rate else self.rng.randrange(2, 10)

    def abort_matching(self, midstep: bool, out) -> None:
        scheduled = {s.request_id: s for s in out.scheduled} if out is not None else {}
        for rid, spec in self.specs.items():
            req = self.sched.get_request(rid)
            if req is None or spec.abort is None or spec.abort_midstep != midstep:
                continue
            if self.in_state(spec, req, scheduled.get(rid)):
                ev = self.sched.finish(rid, RequestStatus.FINISHED_ABORTED)
                assert ev is not None and ev.finish_reason == "abort" and ev.new_token_ids == ()
                assert self.sched.finish(rid, RequestStatus.FINISHED_ABORTED) is None
                self.note_finish(rid, "abort")
                self.aborted[rid] = spec.abort

    @staticmethod
    def in_state(spec: Spec, req, sched_req) -> bool:
        """Is `req` in the lifecycle state the spec aborts it in? (sched_req: its slot, midstep)"""
        running = req.status is RequestStatus.RUNNING
        if spec.abort == "waiting":
            return req.status is RequestStatus.WAITING
        if spec.abort == "preempted":
            return req.status is RequestStatus.PREEMPTED
        if spec.abort == "prefill":  # part of the prompt computed, or a chunk that won't sample
            if sched_req is not None:
                return not sched_req.samples
            return running and 0 < req.num_computed_tokens < req.num_prompt_tokens
        if spec.abort == "decode":
            return running and req.num_output_tokens >= 1
        # "final": this step's update would end it by length.
        return (
            sched_req is not None
            and sched_req.samples
            and req.num_output_tokens + 1 >= req.max_tokens
        )

    def check_output(self, out) -> None:
        cfg, bs = self.cfg, self.cfg.block_size
        assert out.num_batched_tokens == sum(len(s.token_ids) + s.num_draft_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs and self.sched.num_running <= cfg.max_num_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        written: set[int] = set()
        for s in out.scheduled:
            truth = self.tokens[s.request_id]
            end = s.start_position + len(s.token_ids)
            assert len(s.token_ids) >= 1 and s.token_ids == tuple(truth[s.start_position:end])
            assert s.samples == (end == len(truth))
            assert len(s.block_table) * bs >= end + s.num_draft_tokens
            assert list(s.block_table) == self.kv.block_table(s.request_id)
            assert s.num_draft_tokens == 0 or (s.samples and len(s.token_ids) == 1)
            blocks = {s.block_table[p // bs] for p in range(s.start_position, end + s.num_draft_tokens)}
            assert not blocks & written, "two requests write the same block in one step"
            written |= blocks
            # A block cached before this step holds computed tokens: written only if it was
            # evicted and handed out again in this step.
            assert all(b not in self.pre_step_hashes or b in self.fresh for b in blocks)
        self.pre_step_hashes = self.snapshot_hashes()
        self.fresh.clear()
        self.run_attention(out)

    def run_attention(self, out) -> None:
        """Write every new token's KV (all of them first, like each layer does), then check that
        each request's whole context reads back its own tokens under its own salt."""
        bs = self.cfg.block_size
        for s in out.scheduled:
            fps, salt = self.fingerprints_of(s.request_id), self.specs[s.request_id].salt
            for p in range(s.start_position, s.start_position + len(s.token_ids)):
                self.kv_slots[s.block_table[p // bs] * bs + p % bs] = (fps[p], salt)
            end = s.start_position + len(s.token_ids)
            for p in range(end, end + s.num_draft_tokens):  # unverified: must never be read as context
                self.kv_slots[s.block_table[p // bs] * bs + p % bs] = ("draft", s.draft_token_ids[p - end])
        for s in out.scheduled:
            fps, salt = self.fingerprints_of(s.request_id), self.specs[s.request_id].salt
            for p in range(s.start_position):
                got = self.kv_slots.get(s.block_table[p // bs] * bs + p % bs)
                assert got == (fps[p], salt), f"{s.request_id} reads wrong KV at position {p}"

    def fingerprints_of(self, rid: str) -> list[int]:
        truth, fps = self.tokens[rid], self.fingerprints.setdefault(rid, [])
        for token in truth[len(fps):]:
            fps.append(hash((fps[-1] if fps else 0, token)))
        return fps

    def snapshot_hashes(self) -> dict[int, bytes]:
        return {b.block_id: b.block_hash for b in self.kv.pool.blocks if b.block_hash is not None}

    def record(self, events, sampled) -> None:
        for ev in events:
            assert ev.request_id not in self.finished, f"event after finish for {ev.request_id}"
            value = sampled[ev.request_id]
            truth = self.tokens[ev.request_id]
            expect = None
            appended = []
            for token in (value if isinstance(value, list) else [value]):  # stops cut an accepted run
                truth.append(token)
                appended.append(token)
                expect = self.expected_reason(self.specs[ev.request_id], truth)
                if expect is not None:
                    break
            assert ev.new_token_ids == tuple(appended)
            assert ev.finish_reason == expect
            if ev.request_id in self.accepted:  # an accepted draft's KV is that token's true KV
                scheduled, accepted = self.accepted.pop(ev.request_id)
                fps, salt, bs = self.fingerprints_of(ev.request_id), self.specs[ev.request_id].salt, self.cfg.block_size
                end = scheduled.start_position + 1
                for p in range(end, end + min(accepted, len(appended))):
                    self.kv_slots[scheduled.block_table[p // bs] * bs + p % bs] = (fps[p], salt)
            if expect is not None:
                assert ev.stop_token_id == (truth[-1] if expect == "stop" else None)
                self.note_finish(ev.request_id, expect)

    @staticmethod
    def expected_reason(spec: Spec, truth: list[int]) -> str | None:
        outputs = truth[len(spec.prompt):]
        last = outputs[-1]
        stop_ids = (STOP,) if spec.use_stop else ()
        is_stop = last in stop_ids or (last == EOS and not spec.ignore_eos)
        if is_stop and len(outputs) >= spec.min_tokens:
            return "stop"
        return "length" if len(outputs) >= spec.max_tokens else None

    def note_finish(self, rid: str, reason: str) -> None:
        assert rid not in self.finished, f"two finish events for {rid}"
        self.finished[rid] = reason

    def check_end(self) -> None:
        assert set(self.finished) == set(self.specs), "a request ended without a finish event"
        for rid, req in self.requests.items():
            assert req.is_finished and req.status.finish_reason == self.finished[rid]
            assert list(req.all_token_ids) == self.tokens[rid]
        assert self.sched.num_running == 0 and self.sched.num_waiting == 0
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        self.sched.check_integrity()
        self.kv.check_integrity([])


def run_scenario(config: dict, specs: list[Spec], seed: int, eos_rate: float = 0.1, spec_rate: float = 0.0) -> Driver:
    driver = Driver(config, specs, seed, eos_rate, spec_rate)
    driver.run()
    return driver


COMMON = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@settings(max_examples=500, **COMMON)
@given(scenarios())
def test_random_traffic(scenario):
    run_scenario(*scenario)


@settings(max_examples=250, **COMMON)
@given(scenarios(abort_rate=1.0))
def test_random_traffic_with_aborts_everywhere(scenario):
    run_scenario(*scenario)


@settings(max_examples=250, **COMMON)
@given(scenarios(abort_rate=0.2, pool_slack=2, requests=(3, 16), max_arrival=4))
def test_tiny_pools(scenario):
    run_scenario(*scenario)


@settings(max_examples=300, **COMMON)
@given(scenarios(abort_rate=0.3, pool_slack=4))
def test_random_traffic_with_speculative_rows(scenario):
    config, specs, seed, eos_rate, _ = scenario
    run_scenario(config, specs, seed, eos_rate, spec_rate=0.6)


@pytest.mark.parametrize(
    ("state", "midstep"),
    [(state, mid) for state in ABORT_STATES for mid in (False, True) if mid or state != "final"],
)
def test_abort_in_each_state_is_reached(state, midstep):
    # Four long requests on a pool that fits about two: chunked prefill, decode and preemption.
    config = dict(block_size=2, num_blocks=12, max_num_seqs=3, max_num_batched_tokens=5,
                  max_model_len=64, max_waiting=8, policy="fcfs", enable_prefix_caching=True)
    specs = [Spec(f"r{i}", i, [100 + 10 * i + j for j in range(9)], 8, 8, False, False, 0,
                  state if i == 3 else None, midstep) for i in range(4)]
    specs.append(Spec("r4", 0, [7] * 3, 8, 8, False, False, 0, state, midstep))
    driver = run_scenario(config, specs, seed=1)
    assert driver.aborted, f"no request was ever in state {state!r}"
    assert all(driver.finished[rid] == "abort" for rid in driver.aborted)
