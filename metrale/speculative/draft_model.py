"""The draft-model proposer: a smaller model of the same tokenizer proposes drafts on the MLX thread.

It has its own KV pools with the target's geometry of blocks (same num_blocks and block_size) and
reads them through the target's block tables, so its KV needs no accounting of its own: a draft
position lives in the slot the target uses for the same position of the same request. Its KV is
filled lazily, only for requests that speculate:

    known tokens  0 ........ valid-1 | valid ...... L |  d1 ... d(k-1)
                  draft KV computed    catch-up now    drafts fed back (their KV is speculative)

`valid` (per request) is where its draft KV stops being trustworthy: the end of last step's known
tokens, or 0 when the request's block table changed (a preemption moved its blocks). Each step it
proposes with one batched catch-up forward, then k - 1 single-token forwards that feed each argmax
back on the device; one .tolist() at the end.
"""

from __future__ import annotations

from collections.abc import Iterable

from kernels.runtime import mx
from kvcache.attention import AttentionMetadata
from kvcache.storage import PagedKVCache
from metrale.speculative.proposers import DraftRequest


class DraftModelProposer:
    """Proposes greedy drafts with a draft model over its own paged KV (runner side)."""

    def __init__(self, model, kv_cache: PagedKVCache, attention_backend: str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = attention_backend
        self._valid: dict[str, int] = {}  # request id -> positions whose draft KV is right
        self._tables: dict[str, tuple[int, ...]] = {}  # the block table that KV was written through

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Up to num_drafts greedy drafts per request (batched over `requests`)."""
        if not requests:
            return {}
        starts = [self._valid_prefix(r) for r in requests]
        # catch-up: positions start .. L of each request, one flat batch; its last rows give d1
        segments = [r.context[start:] for r, start in zip(requests, starts)]
        metadata = self._metadata([len(s) for s in segments], [len(r.context) for r in requests], requests)
        flat = mx.array([t for s in segments for t in s], dtype=mx.int32)  # (T,)
        hidden = self.model(flat, metadata.positions, self.kv_cache, metadata)  # (T, D)
        last_rows = mx.array([sum(len(s) for s in segments[:i + 1]) - 1 for i in range(len(segments))],
                             dtype=mx.int32)
        tokens = mx.argmax(self.model.compute_logits(hidden[last_rows]), axis=-1).astype(mx.int32)  # (R,) d1
        drafts = [tokens]
        for step in range(1, max(r.num_drafts for r in requests)):
            active = [i for i, r in enumerate(requests) if r.num_drafts > step]  # never past a lookahead
            group = [requests[i] for i in active]
            metadata = self._metadata([1] * len(group), [len(r.context) + step for r in group], group)
            fed = tokens if len(active) == len(requests) else tokens[mx.array(active, dtype=mx.int32)]
            hidden = self.model(fed, metadata.positions, self.kv_cache, metadata)  # (A, D); d_step at L + step
            next_tokens = mx.argmax(self.model.compute_logits(hidden), axis=-1).astype(mx.int32)  # (A,)
            if len(active) == len(requests):
                tokens = next_tokens
            else:  # requests that are done keep their last draft in place (sliced off below)
                tokens = mx.array(tokens)
                tokens[mx.array(active, dtype=mx.int32)] = next_tokens
            drafts.append(tokens)
        stacked = mx.stack(drafts, axis=1)  # (R, max k)
        mx.eval(stacked, [pool for layer in range(self.kv_cache.num_layers) for pool in self.kv_cache.layer(layer)])
        proposed = stacked.tolist()
        for r in requests:
            self._valid[r.request_id] = len(r.context)
            self._tables[r.request_id] = r.block_table
        return {r.request_id: row[:r.num_drafts] for r, row in zip(requests, proposed)}

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """The target copied these blocks for forked requests: the draft pools copy them too. Safe to
        repeat (a retried step): the child rewrites only positions after those its parent had computed."""
        self.kv_cache.copy_blocks(copies)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._valid.pop(request_id, None)
            self._tables.pop(request_id, None)

    def _valid_prefix(self, request: DraftRequest) -> int:
        """Where to start computing: the draft KV before it is right, and at least x_L is recomputed."""
        valid = self._valid.get(request.request_id, 0)
        table = self._tables.get(request.request_id, ())
        if request.block_table[:len(table)] != table:
            valid = 0  # its blocks moved (preempted and recomputed): nothing of the old draft KV holds
        return min(valid, len(request.context) - 1)

    def _metadata(self, query_lens: list[int], context_lens: list[int], requests: list[DraftRequest]) -> AttentionMetadata:
        return AttentionMetadata.build(query_lens, context_lens, [r.block_table for r in requests],
                                       self.kv_cache.block_size, backend=self.backend)
