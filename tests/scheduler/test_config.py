"""SchedulerConfig: frozen, validated, errors name the field."""

import dataclasses

import pytest

from scheduler import SchedulerConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_seqs", 0),
        ("max_num_seqs", 2.0),
        ("max_num_batched_tokens", 0),
        ("max_num_batched_tokens", True),
        ("max_model_len", -1),
        ("max_waiting", 0),
        ("block_size", 0),
        ("block_size", "16"),
        ("policy", "lifo"),
        ("enable_prefix_caching", 1),
    ],
)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_budget_must_cover_one_token_per_sequence():
    message = r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(9\)"
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(max_num_seqs=9, max_num_batched_tokens=8)


def test_frozen_with_defaults():
    cfg = SchedulerConfig()
    assert (cfg.policy, cfg.block_size, cfg.enable_prefix_caching) == ("fcfs", 16, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 3
    assert dataclasses.replace(cfg, policy="priority").policy == "priority"
