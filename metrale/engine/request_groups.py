"""The request groups of parallel sampling (n > 1): the sequences of one request live and die together.

A group is known by its first id (the head: aborting it aborts every live sequence) and by each of its
sequences' ids (one sequence's error fails the others). A group is forgotten when its last sequence ends.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Group:
    """The sequences of one request: its first id and the ids still live."""

    __slots__ = ("head", "live")

    def __init__(self, head: str, live: list[str]) -> None:
        self.head = head
        self.live = live


class RequestGroups:
    """Which live sequences belong together, by any member's id or by the group's first id."""

    def __init__(self) -> None:
        self._by_member: dict[str, _Group] = {}  # a live sequence id -> its group
        self._by_head: dict[str, _Group] = {}  # a group's first id -> the group, while any sequence lives

    def add(self, request_ids: Sequence[str]) -> None:
        """Register the sequences of one request (its first id is the group's head)."""
        group = _Group(request_ids[0], list(request_ids))
        self._by_member.update((request_id, group) for request_id in request_ids)
        self._by_head[group.head] = group

    def live_of_head(self, request_id: str) -> list[str] | None:
        """The live sequences of the group whose first id is `request_id`, or None (not a group's head)."""
        group = self._by_head.get(request_id)
        return None if group is None else list(group.live)

    def siblings(self, request_id: str) -> list[str]:
        """The other live sequences of `request_id`'s group (none for a request of one sequence)."""
        group = self._by_member.get(request_id)
        return [] if group is None else [member for member in group.live if member != request_id]

    def retire(self, request_id: str) -> None:
        """A sequence ended; the group goes with its last one."""
        group = self._by_member.pop(request_id, None)
        if group is not None:
            group.live.remove(request_id)
            if not group.live:
                del self._by_head[group.head]
