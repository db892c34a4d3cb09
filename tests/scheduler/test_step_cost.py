"""The step cost model (learned online), on made-up step times."""

import math

import pytest

from scheduler.step_cost import OnlineStepCost, StepWork, attention_pairs


def true_cost(work: StepWork) -> float:
    return 0.004 + 0.0005 * work.num_tokens + 2e-8 * work.num_attention_pairs + 3e-6 * work.num_context_tokens


def teach(model: OnlineStepCost, cost=true_cost) -> None:
    """Decode-only steps of 4 streams and prompt chunks of several sizes at growing contexts."""
    for context in (10, 300, 900):
        decodes = StepWork.of_decodes(4, 4 * context)
        model.observe(decodes, cost(decodes))
    for start, n in ((0, 512), (512, 512), (4096, 64), (8000, 192), (6000, 8)):
        chunk = StepWork.of_chunk(start, n)
        model.observe(chunk, cost(chunk))


def test_attention_pairs_count_causal_query_key_pairs():
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(5, 3) == 6 + 7 + 8
    assert StepWork.of_chunk(5, 3) == StepWork(3, 21, True, 8)
    assert StepWork.of_chunk(7, 1).has_chunk is False
    assert StepWork.of_decodes(4, 400) == StepWork(4, 400, False, 400)


def test_learns_the_four_coefficients_from_exact_times():
    model = OnlineStepCost()
    teach(model)
    for work in (StepWork.of_decodes(4, 40), StepWork.of_chunk(6000, 100), StepWork(300, 10**7, True, 9000)):
        assert model.estimate(work) == pytest.approx(true_cost(work), rel=1e-6)


def test_a_small_chunk_at_a_long_context_costs_its_context_reads():
    """A chunk's KV reads cost whatever its length (measured: 1 token at 8k ~56 ms, 4 tokens ~64 ms on
    135M): a fit that knows the term prices a 1-token chunk at 8k far above a quarter of a 4-token one."""
    model = OnlineStepCost()
    teach(model)
    decodes = StepWork.of_decodes(4, 1000)
    one, four = (model.estimate(decodes + StepWork.of_chunk(8000, n)) - model.estimate(decodes) for n in (1, 4))
    assert one == pytest.approx(0.0005 + 2e-8 * 8001 + 3e-6 * 8001, rel=1e-6)
    assert one > 0.5 * four


def test_knows_nothing_until_chunks_and_two_token_counts_were_seen():
    model = OnlineStepCost(min_observations=2)
    for _ in range(5):
        model.observe(StepWork(4, 100), 0.01)
    assert model.estimate(StepWork(4, 100)) is None  # decodes alone never tell what a chunk costs
    model.observe(StepWork.of_chunk(0, 64), 0.05)
    assert model.estimate(StepWork(4, 100)) is None
    model.observe(StepWork.of_chunk(64, 64), 0.06)
    assert model.estimate(StepWork(4, 100)) is not None
    alone = OnlineStepCost(min_observations=2)
    for start in range(0, 256, 64):  # one token count: fixed and per-token cost are not separable
        alone.observe(StepWork.of_chunk(start, 64), 0.05 + start * 1e-5)
    assert alone.estimate(StepWork(4, 100)) is None
    alone.observe(StepWork.of_chunk(256, 32), 0.04)
    assert alone.estimate(StepWork(4, 100)) is not None


def test_coefficients_stay_non_negative_on_noisy_times():
    model = OnlineStepCost()
    # longer contexts measured faster (noise): an unconstrained fit would give a negative per-pair cost
    for pairs, seconds in ((100, 0.012), (50_000, 0.011), (200_000, 0.010)):
        model.observe(StepWork(4, pairs), seconds)
    for n, seconds in ((64, 0.05), (128, 0.08)):
        model.observe(StepWork.of_chunk(10_000 // n, n), seconds)
    assert min(model.coefficients) >= 0.0
    assert model.estimate(StepWork.of_chunk(0, 256)) > model.estimate(StepWork.of_chunk(0, 128))


def test_old_steps_age_out_of_the_window():
    model = OnlineStepCost(window=8)
    slow = lambda work: 3 * true_cost(work)  # noqa: E731
    for _ in range(3):
        teach(model, slow)
    for _ in range(3):
        teach(model)  # the machine got faster (another process left)
    work = StepWork.of_chunk(100, 200)
    assert model.estimate(work) == pytest.approx(true_cost(work), rel=1e-6)


@pytest.mark.parametrize("seconds", [-0.001, math.nan])
def test_bad_observation_raises_and_changes_nothing(seconds):
    model = OnlineStepCost()
    teach(model)
    before = model.coefficients
    with pytest.raises(ValueError, match="cannot take"):
        model.observe(StepWork(4, 10), seconds)
    assert model.coefficients == before


def test_window_must_hold_the_observations_it_waits_for():
    with pytest.raises(ValueError, match="min_observations"):
        OnlineStepCost(window=2, min_observations=3)


class Linear:
    """A known cost: fixed + per_token * tokens + per_pair * pairs + per_context * context tokens (seconds)."""

    def __init__(self, fixed=0.01, per_token=0.001, per_pair=0.0, per_context=0.0):
        self.terms = (fixed, per_token, per_pair, per_context)

    def estimate(self, work):
        fixed, per_token, per_pair, per_context = self.terms
        return (fixed + per_token * work.num_tokens + per_pair * work.num_attention_pairs
                + per_context * work.num_context_tokens)

    def observe(self, work, seconds):
        raise AssertionError("a fixed model learns nothing")

    def largest_known_step(self):
        return None  # exact at any size

    def decode_step_seconds(self, decodes):
        return self.estimate(decodes)

    def wants_decode_step(self):
        return False


def test_steps_of_one_token_count_rescale_the_last_fit_to_follow_the_load():
    model = OnlineStepCost(window=8)
    teach(model)
    fitted = model.coefficients
    step = StepWork(17, 5000, True)  # a long prompt's chunks settled at one size beside the same streams
    for _ in range(8):
        model.observe(step, 3 * true_cost(step))  # the machine got 3x busier
    assert model.coefficients is not None
    assert model.coefficients == pytest.approx(tuple(3 * c for c in fitted))
    assert model.estimate(step) == pytest.approx(3 * true_cost(step))


def test_decode_step_time_is_the_median_of_recent_decode_only_steps_of_as_many_decodes():
    model = OnlineStepCost()
    teach(model)
    assert model.decode_step_seconds(StepWork(8, 800)) == model.estimate(StepWork(8, 800))  # none of 8 measured
    for seconds in (0.050, 0.010, 0.030, 0.020, 0.900):  # the older ones fall out of the last three
        model.observe(StepWork(4, 4000), seconds)
    assert model.decode_step_seconds(StepWork(4, 4000)) == 0.030


def test_the_work_of_a_step_counts_a_one_token_prompt_chunk_as_a_chunk():
    from scheduler import ScheduledRequest, SchedulerOutput

    decode = ScheduledRequest("d", (5,), 40, (0, 1, 2), samples=True, num_draft_tokens=2)
    one = ScheduledRequest("p", (6,), 100, (3,) * 7, samples=False)  # a prompt's 1-token chunk, not its last
    output = SchedulerOutput((decode,), 3, (), 16)
    assert StepWork.of_output(output) == StepWork(3, attention_pairs(40, 3), False, 43)
    both = SchedulerOutput((decode, one), 4, (), 16)
    assert StepWork.of_output(both) == StepWork(4, attention_pairs(40, 3) + 101, True, 43 + 101)
