"""One step's time budget (absolute and relative limits), on an injected cost model."""

from scheduler.step_budget import StepLimit, StepTimeBudget
from scheduler.step_cost import OnlineStepCost, StepWork
from tests.scheduler.test_step_cost import Linear


def test_budget_fits_the_chunk_to_the_time_left_after_the_decodes():
    budget = StepTimeBudget(Linear(), StepLimit(0.050), min_chunk=8, decodes=StepWork(4, 400))
    # 10 ms fixed + 4 decode tokens = 14 ms; 36 more tokens fit in 50 ms
    assert budget.fit_chunk(0, 500) == 36
    assert budget.fit_chunk(0, 20) == 20  # a short chunk fits whole


def test_budget_shrinks_chunks_at_long_context():
    model = Linear(per_pair=1e-7)
    near = StepTimeBudget(model, StepLimit(0.050), 8, StepWork(4, 400)).fit_chunk(0, 500)
    far = StepTimeBudget(model, StepLimit(0.050), 8, StepWork(4, 400)).fit_chunk(8000, 500)
    assert far < near
    work = StepWork(4, 400) + StepWork.of_chunk(8000, far)
    assert model.estimate(work) <= 0.050 < model.estimate(work + StepWork.of_chunk(8000 + far, 1))


def test_first_chunk_gets_the_floor_and_later_ones_only_what_is_left():
    budget = StepTimeBudget(Linear(), StepLimit(0.015), min_chunk=8, decodes=StepWork(4, 400))
    first = budget.fit_chunk(0, 500)
    assert first == 8  # only 1 token fits in time; the floor keeps the prompt moving
    budget.take_chunk(0, first)
    assert budget.fit_chunk(0, 300) == 0


def test_budget_is_off_without_decodes_or_limit_and_floors_while_unlearned():
    assert StepTimeBudget(Linear(), StepLimit(0.015), 8, StepWork()).fit_chunk(0, 500) == 500
    assert StepTimeBudget(Linear(), StepLimit(), 8, StepWork(4, 400)).fit_chunk(0, 500) == 500
    assert StepTimeBudget(OnlineStepCost(), StepLimit(0.5), 8, StepWork(4, 400)).fit_chunk(0, 500) == 8
    assert StepTimeBudget(OnlineStepCost(), StepLimit(0.5), 8, StepWork(4, 400), probe=True).fit_chunk(0, 500) == 16


def test_relative_limit_is_a_multiple_of_the_decodes_own_estimate():
    model = Linear(fixed=2 ** -7, per_token=2 ** -10)  # powers of two: exact sums
    budget = StepTimeBudget(model, StepLimit(decode_factor=2.0), min_chunk=1, decodes=StepWork(4, 400))
    # decodes alone: fixed + 4 tokens = 12 token-times; twice that leaves 12 more tokens
    assert budget.limit_s == 2 * model.estimate(StepWork(4, 400))
    assert budget.fit_chunk(0, 500) == 12
    slower = StepTimeBudget(model, StepLimit(decode_factor=2.0), min_chunk=1, decodes=StepWork(16, 1600))
    assert slower.fit_chunk(0, 500) == 24  # more decodes: a longer step, more room


def test_with_both_limits_the_smaller_holds():
    model = Linear(fixed=2 ** -7, per_token=2 ** -10)
    assert StepTimeBudget(model, StepLimit(20 * 2 ** -10, 2.0), 1, StepWork(4, 400)).fit_chunk(0, 500) == 8
    assert StepTimeBudget(model, StepLimit(0.100, 2.0), 1, StepWork(4, 400)).fit_chunk(0, 500) == 12


def test_relative_limit_waits_for_the_model_and_probes_meanwhile():
    budget = StepTimeBudget(OnlineStepCost(), StepLimit(decode_factor=2.0), 1, StepWork(4, 400))
    assert budget.limit_s is None
    assert budget.fit_chunk(0, 500) == 8  # the probe chunk does not shrink with the floor
    budget.take_chunk(0, 8)
    assert budget.fit_chunk(8, 500) == 0  # one probe a step
    assert StepTimeBudget(Linear(), StepLimit(), 1, StepWork(4, 400)).limit_s is None  # no limit: inactive


def test_a_floor_of_one_token_is_charged_to_the_step():
    budget = StepTimeBudget(Linear(), StepLimit(0.0141), min_chunk=1, decodes=StepWork(4, 400))
    assert budget.fit_chunk(0, 500) == 1
    budget.take_chunk(0, 1)
    assert budget.planned_s() == Linear().estimate(StepWork(5, 401))
    assert budget.fit_chunk(0, 300) == 0  # a second prompt gets no floor


def scaled(factor: float):
    return lambda work: factor * (0.004 + 0.0005 * work.num_tokens + 2e-8 * work.num_attention_pairs)


def teach_steps(model: OnlineStepCost, cost, rounds: int) -> None:
    """Decode-only steps of 4 streams and steps of 4 decodes + a chunk, at growing contexts."""
    for r in range(rounds):
        decodes = StepWork(4, 4 * (100 + r))
        model.observe(decodes, cost(decodes))
        step = decodes + StepWork.of_chunk(64 * r, 8 + r % 24)
        model.observe(step, cost(step))


def test_relative_limit_keeps_its_chunks_when_every_step_slows_down_and_an_absolute_one_shrinks():
    model = OnlineStepCost()
    decodes = StepWork(4, 4000)
    teach_steps(model, scaled(1.0), 40)
    relative = StepTimeBudget(model, StepLimit(decode_factor=2.0), 1, decodes).fit_chunk(4000, 500)
    absolute = StepTimeBudget(model, StepLimit(0.030), 1, decodes).fit_chunk(4000, 500)
    teach_steps(model, scaled(2.0), 40)  # the machine got busy: every step takes twice as long
    assert StepTimeBudget(model, StepLimit(decode_factor=2.0), 1, decodes).fit_chunk(4000, 500) == relative > 1
    assert StepTimeBudget(model, StepLimit(0.030), 1, decodes).fit_chunk(4000, 500) < absolute


def test_a_step_over_its_limit_anyway_gets_a_chunk_at_the_knee_not_one_token():
    # per token 1 ms + 1 us per context token; per chunk 1 us per context token: at 8000, ~8 ms a chunk
    model = Linear(fixed=0.004, per_token=0.001, per_pair=1e-6, per_context=1e-6)
    decodes = StepWork.of_decodes(4, 400)
    over = StepTimeBudget(model, StepLimit(0.010), min_chunk=1, decodes=decodes)
    assert over.knee(8000) == 1  # 9 ms a token, 8 ms a chunk: one token already outweighs the chunk
    cheap = Linear(fixed=0.004, per_token=0.0001, per_pair=1e-8, per_context=1e-6)
    budget = StepTimeBudget(cheap, StepLimit(0.010), min_chunk=1, decodes=decodes)
    assert budget.knee(8000) == 45  # 8.0 ms a chunk over 0.18 ms a token
    assert budget.fit_chunk(8000, 500) == 45  # even 1 token is over 10 ms: the step moves 45, not 1
    roomy = StepTimeBudget(cheap, StepLimit(0.020), min_chunk=1, decodes=decodes)
    fitting = roomy.fit_chunk(8000, 500)
    assert 1 <= fitting < 45  # what fits the limit, even below the knee: the limit comes first
    work = decodes + StepWork.of_chunk(8000, fitting)
    assert cheap.estimate(work) <= 0.020 < cheap.estimate(work + StepWork.of_chunk(8000 + fitting, 1))
    assert StepTimeBudget(Linear(), StepLimit(0.010), 1, decodes).knee(8000) == 1  # nothing per chunk
