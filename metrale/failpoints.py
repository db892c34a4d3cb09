"""Failpoints: inject faults into a real engine, for tests, users and their chaos tooling.

Read once when the engine starts, from METRALE_FAILPOINTS (or EngineConfig(failpoints=...), which wins;
metrale.settings.RuntimeSettings.failpoints holds the choice):

    METRALE_FAILPOINTS="detokenize=0.01,execute=@victim"

a comma-separated list of `name=P` (raise with probability P each time the point is passed),
`name=@REQUEST_ID` (raise whenever the point is passed for that request) or `name=hang@REQUEST_ID` (block the
thread there, as a native call that never returns would, until `disarm`; e.g. execute=hang@id stalls the MLX
thread in a step). The points:

    tokenize     encoding a prompt or rendering chat messages       (submit: the caller gets the error)
    schedule     planning a step                                   (per step, before the scheduler runs)
    execute      the batched forward on the MLX thread              (per step; @id: steps holding that request)
    sample       building a row's sampling parameters               (per sampled row, on the MLX thread)
    detokenize   turning a request's new tokens into text           (per request per step)
    stop_match   matching its stop strings                          (per request per step)
    deliver      handing a delta to its stream                      (per request per step)

A raised fault is an `InjectedFault` (a RuntimeError). Unset, the engine holds `NO_FAILPOINTS`, whose
`check` does nothing.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

POINTS = ("tokenize", "schedule", "execute", "sample", "detokenize", "stop_match", "deliver")
ENV = "METRALE_FAILPOINTS"


class InjectedFault(RuntimeError):
    """A fault raised by a failpoint on purpose."""

    def __init__(self, point: str, request_id: str | None) -> None:
        target = f" for request {request_id!r}" if request_id is not None else ""
        super().__init__(f"failpoint {point!r} fired{target}")
        self.point = point
        self.request_id = request_id


@dataclass(frozen=True)
class Failpoint:
    """One armed point: a probability, or the request ids it always fires for (or hangs for)."""

    probability: float = 0.0
    request_ids: frozenset[str] = frozenset()
    hang_ids: frozenset[str] = frozenset()


@dataclass
class Failpoints:
    """The armed points of one engine; `check(point, request_id)` raises when one fires."""

    points: dict[str, Failpoint] = field(default_factory=dict)
    seed: int | None = None
    fired: dict[str, int] = field(default_factory=dict)  # point -> times it raised

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._released = threading.Event()  # set by disarm: a hung point returns

    @classmethod
    def parse(cls, spec: str, seed: int | None = None) -> "Failpoints":
        """From "name=P,name=@ID,..." (ValueError naming the bad entry)."""
        points: dict[str, Failpoint] = {}
        for entry in (e.strip() for e in spec.split(",")):
            if not entry:
                continue
            name, sep, value = entry.partition("=")
            name = name.strip()
            if not sep or name not in POINTS:
                raise ValueError(f"{ENV}: bad entry {entry!r}; expected name=P, name=@REQUEST_ID or "
                                 f"name=hang@REQUEST_ID with name in {', '.join(POINTS)}")
            current = points.get(name, Failpoint())
            value = value.strip()
            if value.startswith("@") and len(value) > 1:
                points[name] = Failpoint(current.probability, current.request_ids | {value[1:]}, current.hang_ids)
                continue
            if value.startswith("hang@") and len(value) > 5:
                points[name] = Failpoint(current.probability, current.request_ids, current.hang_ids | {value[5:]})
                continue
            try:
                probability = float(value)
            except ValueError:
                probability = -1.0
            if not 0.0 <= probability <= 1.0:
                raise ValueError(f"{ENV}: {entry!r}: the probability must be a number in [0, 1]")
            points[name] = Failpoint(probability, current.request_ids, current.hang_ids)
        return cls(points, seed)

    @classmethod
    def from_spec(cls, spec: str, seed: int | None = None) -> "Failpoints":
        """The failpoints of `spec` (RuntimeSettings.failpoints); NO_FAILPOINTS when it is empty."""
        return cls.parse(spec, seed) if spec.strip() else NO_FAILPOINTS

    def __bool__(self) -> bool:
        return bool(self.points)

    def disarm(self) -> None:
        """No point fires from now on (`fired` keeps its counts); a point hanging now returns."""
        self.points.clear()
        self._released.set()

    def check(self, point: str, request_id: str | None = None) -> None:
        """Raise InjectedFault if `point` fires now (for `request_id`, when given); block until `disarm` if it
        hangs for `request_id`."""
        armed = self.points.get(point)
        if armed is None:
            return
        if request_id is not None and request_id in armed.hang_ids:
            self.fired[point] = self.fired.get(point, 0) + 1
            self._released.wait()
            return
        if (request_id is not None and request_id in armed.request_ids) or (
                armed.probability and self._rng.random() < armed.probability):
            self.fired[point] = self.fired.get(point, 0) + 1
            raise InjectedFault(point, request_id)

    def check_any(self, point: str, request_ids: Iterable[str]) -> None:
        """Raise if `point` fires for any of `request_ids` (probability: once per call)."""
        armed = self.points.get(point)
        if armed is None:
            return
        for request_id in request_ids:
            if request_id in armed.request_ids or request_id in armed.hang_ids:
                self.check(point, request_id)
        self.check(point)


NO_FAILPOINTS = Failpoints()
