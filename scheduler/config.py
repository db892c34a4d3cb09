"""SchedulerConfig: the frozen, validated knobs of the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

POLICIES = ("fcfs", "priority")


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduling limits. Invalid values raise ValueError naming the field.

    Attributes:
        max_num_seqs: most requests running (holding KV blocks) at once.
        max_num_batched_tokens: per-step token budget, summed over all scheduled requests.
        max_model_len: most tokens (prompt + max_tokens) a request may ever hold; None sets no
            limit of its own (the KV pool still bounds a request). The engine sets it at start
            from the model's context length when the user left it None.
        max_waiting: bound on the waiting queue; `add` raises QueueFullError beyond it.
        policy: "fcfs" (arrival order) or "priority" (lower `priority` first, then arrival).
        block_size: tokens per KV block; must match the KVCacheManager's.
        enable_prefix_caching: must match the KVCacheManager's.
        max_loras: most distinct LoRA adapters among the running requests (the runner's resident slots;
            a request for one more waits until one of them has no running request).
        max_step_ms: a time limit for a step that decodes running requests: its prompt chunks are
            cut to fit it, by a cost model learned from the steps run (scheduler/step_cost.py), so a
            long prompt does not stall the streams; None: no absolute limit.
        max_step_factor: the same, relative: a step that decodes takes at most this many times the
            estimated time of its decodes alone (it follows the load and the model size); None: no
            relative limit. With both, the smaller limit holds; with neither, chunks are bounded by
            tokens only (scheduler/step_budget.py).
        min_prefill_chunk: prompt tokens the first chunk of a step gets even when the time limit
            leaves less room (prompts always progress). 1: at 8k of context 8 tokens took ~250 ms on
            135M (a loaded 2-core machine), so a floor of 8 held every step of a long prompt at 4x a 60 ms limit.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    max_waiting: int = 1024
    policy: Literal["fcfs", "priority"] = "fcfs"
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_loras: int = 4
    max_step_ms: float | None = None
    max_step_factor: float | None = None
    min_prefill_chunk: int = 1

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("max_waiting", self.max_waiting, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("max_loras", self.max_loras, 1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request must be able to decode one token in the same step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_step_ms is not None and (
                isinstance(self.max_step_ms, bool) or not isinstance(self.max_step_ms, (int, float))
                or not 0 < self.max_step_ms <= 3_600_000):  # also rejects NaN
            raise ValueError(f"max_step_ms must be None or a number in (0, 3600000], got {self.max_step_ms!r}")
        if self.max_step_factor is not None and (
                isinstance(self.max_step_factor, bool) or not isinstance(self.max_step_factor, (int, float))
                or not 1 < self.max_step_factor <= 1000):  # also rejects NaN; 1 would leave chunks no room
            raise ValueError(f"max_step_factor must be None or a number in (1, 1000], got {self.max_step_factor!r}")
        _check_int("min_prefill_chunk", self.min_prefill_chunk, 1)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
