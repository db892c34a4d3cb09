"""What rank 0 sends the other ranks of a tensor-parallel group, in order, over their pipes:

    FollowerSetup   once: which model to load and how (the follower then joins the ring and loads)
    KVLayout        once: how many KV blocks each pool holds (rank 0 sized them from its budget)
    ForwardInput    per step: the engine's step message (metrale.engine.step), one forward's input in
                    plain Python, which rank 0 builds from the scheduler's output; the end of the pipe
                    means stop
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FollowerSetup", "KVLayout"]


@dataclass(frozen=True, slots=True)
class FollowerSetup:
    """model: as EngineConfig.model; weights_dtype: the mx dtype name load_model gets, None keeps a
    quantized checkpoint quantized; size: the number of ranks."""

    model: str | None
    weights_dtype: str | None
    size: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Every rank's paged pools: num_blocks blocks of block_size tokens (of its own kv heads), stored as
    kv_dtype (an mx dtype name, rank 0's EngineConfig.kv_cache_dtype resolved)."""

    num_blocks: int
    block_size: int
    kv_dtype: str = "float32"
