"""metrale/failpoints.py: the spec's forms, and a point that hangs for a request until it is disarmed (the engine
process's hang watch meets it in tests/metrale/engine/test_engine_process.py)."""

from __future__ import annotations

import threading

import pytest

from metrale.failpoints import Failpoint, Failpoints, InjectedFault


def test_the_three_forms_of_an_entry():
    points = Failpoints.parse("execute=@a, execute=hang@b, sample=0.5")
    assert points.points == {"execute": Failpoint(0.0, frozenset({"a"}), frozenset({"b"})),
                             "sample": Failpoint(0.5)}
    with pytest.raises(ValueError, match="name=hang@REQUEST_ID"):
        Failpoints.parse("nowhere=hang@b")


def test_a_hanging_point_blocks_its_request_until_disarmed():
    points = Failpoints.parse("execute=hang@stuck")
    points.check_any("execute", ["other"])  # passes
    returned = threading.Event()
    thread = threading.Thread(target=lambda: (points.check_any("execute", ["other", "stuck"]), returned.set()))
    thread.start()
    assert not returned.wait(0.2)  # still blocked (a generous bound on the other side: join below)
    points.disarm()
    thread.join(30)
    assert returned.is_set() and points.fired == {"execute": 1}
    with pytest.raises(InjectedFault):
        Failpoints.parse("execute=@x").check("execute", "x")
