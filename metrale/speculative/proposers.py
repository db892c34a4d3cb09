"""The two proposer interfaces, and n-gram prompt lookup.

Host-side proposers (`HostProposer`) make drafts on the event loop before the step is scheduled:

    propose(request_id, token_ids, k) -> up to k draft token ids (fewer, or none, is fine)
    forget(request_id)                -> the request ended: drop what was kept for it

Runner-side proposers (`RunnerProposer`) make them on the MLX thread inside the step, for the requests
the scheduler gave draft slots, from their tokens and block tables: the draft model
(draft_model.DraftModelProposer), or a model's own multi-token-prediction heads (none of the families
metrale loads has them; such a proposer would also keep the target's last hidden states per request).

NgramProposer is prompt lookup decoding: find the most recent earlier occurrence of the longest
suffix n-gram (n from prompt_lookup_max down to prompt_lookup_min) of prompt + output, and propose
the tokens that followed it. Each request keeps an index {n-gram: the position after its latest
occurrence} updated incrementally as its tokens grow, so a proposal costs O(max n) per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


class HostProposer(Protocol):
    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]: ...

    def forget(self, request_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One request to propose for: its known tokens (the last is x_L), its block table (covering
    L + k positions, the drafts' lookahead included) and how many drafts it wants."""

    request_id: str
    context: tuple[int, ...]
    block_table: tuple[int, ...]
    num_drafts: int


class RunnerProposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Up to `num_drafts` draft token ids per request id (batched over `requests`)."""
        ...

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests ended: drop what was kept for them."""
        ...

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Forked requests' partial blocks were copied in the target's pools: copy any KV kept per block."""
        ...


class _NgramIndex:
    """{n-gram: end position of its latest occurrence} over a request's tokens, for n in [low, high]."""

    __slots__ = ("low", "high", "latest", "indexed")

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # tokens[:indexed] have had every n-gram ending inside them recorded

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Record the n-grams that end at positions indexed .. upto - 1 (upto excludes the suffix
        being looked up, so a lookup never finds itself)."""
        for end in range(self.indexed + 1, upto + 1):
            for n in range(self.low, self.high + 1):
                if end >= n:
                    self.latest[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, upto)


class NgramProposer:
    """Prompt lookup: propose what followed the latest earlier occurrence of the current suffix."""

    def __init__(self, prompt_lookup_min: int = 2, prompt_lookup_max: int = 5) -> None:
        self.low, self.high = prompt_lookup_min, prompt_lookup_max
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _NgramIndex(self.low, self.high)
        length = len(token_ids)
        index.extend(token_ids, length - 1)  # every n-gram that ends before the last token
        for n in range(min(self.high, length - 1), self.low - 1, -1):
            end = index.latest.get(tuple(token_ids[length - n:]))
            if end is not None:
                return list(token_ids[end:end + k])
        return []

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
