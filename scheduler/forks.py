"""Parallel sampling (n > 1): the children that wait for their parent's prompt (pure Python).

A request group is one parent and n - 1 children with the same prompt. Only the parent is queued and
computes the prompt; its children wait here, outside the waiting queue and the running list, until
the step that computes the parent's last prompt token has run. Then each child forks (see
KVCacheManager.fork): it shares the parent's full prompt blocks, gets a copy of the partial one and
recomputes only the last prompt token, whose logits it samples its own first token from:

    parent   | p0 ... p(P-2) p(P-1) | t0 ...          its prompt chunks, then its own tokens
    child i  | shared + copied      | p(P-1) -> u0    1 token computed, then its own tokens

A child whose parent ends before that (abort, error) or that finds no free block for its copy
becomes an ordinary waiting request and computes its prompt itself (the prefix cache helps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from scheduler.request import Request


class PendingForks:
    """Children waiting for their parent's prompt, by parent id."""

    def __init__(self) -> None:
        self._children: dict[str, list[Request]] = {}
        self._parent_of: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._parent_of)

    def __iter__(self) -> Iterator[Request]:
        return (child for children in self._children.values() for child in children)

    def add(self, parent_id: str, children: list[Request]) -> None:
        if children:
            self._children[parent_id] = list(children)
            self._parent_of.update((child.request_id, parent_id) for child in children)

    def count(self, parent_id: str) -> int:
        """How many children wait for `parent_id`."""
        return len(self._children.get(parent_id, ()))

    def parent_of(self, child_id: str) -> str | None:
        return self._parent_of.get(child_id)

    def pop(self, parent_id: str) -> list[Request]:
        """The children of `parent_id` (in submission order), no longer waiting here."""
        children = self._children.pop(parent_id, [])
        for child in children:
            del self._parent_of[child.request_id]
        return children

    def remove(self, child: Request) -> bool:
        """Drop one waiting child (it finished); False if it is not waiting here."""
        parent_id = self._parent_of.pop(child.request_id, None)
        if parent_id is None:
            return False
        children = self._children[parent_id]
        children.remove(child)
        if not children:
            del self._children[parent_id]
        return True

    def num_seats(self, is_running: Callable[[str], bool]) -> int:
        """Children of running parents: they will run as soon as the parent's prompt is computed, so
        they hold their max_num_seqs seats already."""
        return sum(len(children) for parent_id, children in self._children.items() if is_running(parent_id))
