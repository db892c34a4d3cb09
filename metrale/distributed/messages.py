"""What rank 0 sends the other ranks of a tensor-parallel group, in order, over their pipes:

    FollowerSetup   once: which model to load and how (the follower then joins the ring and loads)
    KVLayout        once: how many KV blocks each pool holds (rank 0 sized them from its budget)
    ForwardInput    per step: one forward's input in plain Python (rank 0 builds it from the
                    scheduler's output); the end of the pipe means stop

A ForwardInput:

    token_ids     [a a a a a | b | c]    every scheduled token (drafts included), flat   (T,)
    query_lens    [5, 1, 1]              new tokens per sequence                          (S,)
    context_lens  [21, 41, 8]            cached prefix + new tokens per sequence          (S,)
    block_tables  ((..), (..), (..))     each sequence's pool blocks, in order            (S, *)
    block_copies  ((src, dst), ...)      forked requests' partial blocks, copied first in every pool

Every rank builds the same AttentionMetadata from a ForwardInput and runs the model over its own share of the
weights and its own kv heads' paged pools; the all_sums inside the model keep the ranks in step.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.runtime import mx, nn
from kvcache.attention import AttentionMetadata
from kvcache.storage import PagedKVCache

__all__ = ["FollowerSetup", "ForwardInput", "KVLayout"]


@dataclass(frozen=True, slots=True)
class FollowerSetup:
    """model: as EngineConfig.model; weights_dtype: the mx dtype name load_model gets, None keeps a
    quantized checkpoint quantized; size: the number of ranks."""

    model: str | None
    weights_dtype: str | None
    size: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Every rank's paged pools: num_blocks blocks of block_size tokens (of its own kv heads)."""

    num_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class ForwardInput:
    """The plain-Python input of one forward (see the module docstring)."""

    token_ids: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    block_size: int
    block_copies: tuple[tuple[int, int], ...] = ()

    def run(self, model: nn.Module, kv_cache: PagedKVCache, backend: str | None) -> mx.array:
        """The model's final hidden states (T, D), lazy; this step's block copies, then its K/V, are
        written to `kv_cache`."""
        if self.block_copies:
            kv_cache.copy_blocks(self.block_copies)
        metadata = AttentionMetadata.build(self.query_lens, self.context_lens, self.block_tables, self.block_size,
                                           backend=backend)
        return model(mx.array(self.token_ids, dtype=mx.int32), metadata.positions, kv_cache, metadata)  # (T, D)
