"""Waiting queues: the order in which waiting (and preempted) requests are admitted."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from scheduler.request import Request


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def push(self, request: Request) -> None:
        """Queue a new request at the back."""
        self._queue.append(request)

    def push_preempted(self, request: Request) -> None:
        """Requeue a preempted request at the front."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        """The next request to admit."""
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """Remove a request from anywhere (O(n); n <= max_waiting plus preempted)."""
        self._queue.remove(request)


class PriorityQueue:
    """Lowest (priority, arrival_time) first, ties in push order.

    A preempted request goes back under its own key, which puts it ahead of every later arrival
    of its priority: the front of its class, without jumping ahead of more urgent requests.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap)

    def push(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._counter), request)
        )

    def push_preempted(self, request: Request) -> None:
        self.push(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        """Remove a request from anywhere (O(n))."""
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not in the waiting queue")


WaitingQueue = FCFSQueue | PriorityQueue  # the interface both implement


def make_waiting_queue(policy: str) -> WaitingQueue:
    """The waiting queue for a SchedulerConfig.policy."""
    return PriorityQueue() if policy == "priority" else FCFSQueue()
