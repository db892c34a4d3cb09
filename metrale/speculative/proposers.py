"""Host-side proposers: drafts made on the event loop before the step is scheduled.

    propose(request_id, token_ids, k) -> up to k draft token ids (fewer, or none, is fine)
    forget(request_id)                -> the request ended: drop what was kept for it

NgramProposer is prompt lookup decoding: find the most recent earlier occurrence of the longest
suffix n-gram (n from prompt_lookup_max down to prompt_lookup_min) of prompt + output, and propose
the tokens that followed it. Each request keeps an index {n-gram: the position after its latest
occurrence} updated incrementally as its tokens grow, so a proposal costs O(max n) per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class HostProposer(Protocol):
    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]: ...

    def forget(self, request_id: str) -> None: ...


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
