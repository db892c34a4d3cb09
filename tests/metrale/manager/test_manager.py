"""ModelManager's policy with engine doubles: load on demand (once), LRU eviction of idle models only, the budget,
keep_alive and idle unloads, failed loads, engine deaths, the load queue's bound, drain and shutdown."""

from __future__ import annotations

import asyncio
import math

import pytest

from metrale.manager.errors import (LoadQueueFullError, ManagerClosedError, ModelLoadError, NoRoomError,
                                    UnknownModelError)
from tests.metrale.manager.fakes import make_manager


async def _settle() -> None:
    for _ in range(20):  # let spawned unload / watch tasks run their synchronous parts
        await asyncio.sleep(0)


@pytest.fixture
async def three():
    """Models a, b, c of 100 MB each under a 250 MB budget: two fit."""
    manager, factory, clock = make_manager({"a": 100, "b": 100, "c": 100}, 250)
    await manager.start()
    yield manager, factory, clock
    await manager.shutdown()
    assert all(engine.state == "stopped" for engine in factory.built)
    assert manager._tasks == set()


def _status(manager) -> dict[str, str]:
    return {model_id: slot.status for model_id, slot in manager.slots.items()}


async def test_first_request_loads_and_later_ones_reuse_the_engine(three):
    manager, factory, _ = three
    assert _status(manager) == {"a": "unloaded", "b": "unloaded", "c": "unloaded"}
    lease = await manager.acquire("a")
    assert lease.engine.health() == "serving" and lease.model_id == "a"
    lease.release()
    again = await manager.acquire(None)  # the default model is the first
    assert again.engine is lease.engine and len(factory.built) == 1
    again.release()
    assert _status(manager)["a"] == "loaded"


async def test_concurrent_first_requests_load_once(three):
    manager, factory, _ = three
    factory.gates["a"] = gate = asyncio.Event()
    waiters = [asyncio.create_task(manager.acquire("a")) for _ in range(5)]
    await _settle()
    assert _status(manager)["a"] == "loading" and manager.slots["a"].waiting == 5
    gate.set()
    leases = await asyncio.gather(*waiters)
    assert len(factory.built) == 1 and {lease.engine for lease in leases} == {factory.built[0]}
    assert manager.slots["a"].leases == 5
    for lease in leases:
        lease.release()
    assert manager.slots["a"].leases == 0


async def test_a_cancelled_waiter_leaves_the_load_running_for_the_others(three):
    manager, factory, _ = three
    factory.gates["a"] = gate = asyncio.Event()
    first, second = asyncio.create_task(manager.acquire("a")), asyncio.create_task(manager.acquire("a"))
    await _settle()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    gate.set()
    lease = await second
    assert lease.engine.health() == "serving" and manager.slots["a"].leases == 1
    lease.release()


async def test_loading_past_the_budget_unloads_the_least_recently_used_idle_model(three):
    manager, factory, clock = three
    for name in ("a", "b"):
        clock.now += 1
        (await manager.acquire(name)).release()
    clock.now += 1
    (await manager.acquire("a")).release()  # a is now more recent than b
    lease = await manager.acquire("c")
    await _settle()
    assert _status(manager) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    assert factory.engines("b")[0].shutdowns == 1 and factory.engines("a")[0].shutdowns == 0
    assert manager.resident_bytes() == 200 << 20
    lease.release()


async def test_a_model_with_a_request_is_never_unloaded(three):
    manager, factory, clock = three
    held = await manager.acquire("a")
    clock.now += 1
    (await manager.acquire("b")).release()
    clock.now += 1
    lease = await manager.acquire("c")  # a is the least recently used, but held: b goes
    assert _status(manager)["a"] == "loaded" and factory.engines("a")[0].shutdowns == 0
    with pytest.raises(NoRoomError, match="held by models in use"):
        await manager.acquire("b")  # a and c are both held now
    assert _status(manager)["b"] == "unloaded"  # no room is not a failed load
    held.release()
    lease.release()
    (await manager.acquire("b")).release()  # now one of them is idle
    assert _status(manager)["b"] == "loaded"


async def test_a_model_larger_than_the_budget_is_refused_at_once():
    manager, factory, _ = make_manager({"huge": 300}, 250)
    await manager.start()
    with pytest.raises(NoRoomError, match="more than the whole budget"):
        await manager.acquire("huge")
    assert factory.built == [] and manager.slots["huge"].leases == 0
    await manager.shutdown()


async def test_a_failed_load_answers_its_waiters_and_leaves_the_others_serving(three):
    manager, factory, _ = three
    other = await manager.acquire("b")
    factory.gates["a"] = gate = asyncio.Event()
    factory.failures["a"] = ValueError("not a GGUF file: bad magic")
    waiters = [asyncio.create_task(manager.acquire("a")) for _ in range(3)]
    await _settle()
    gate.set()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, ModelLoadError) and "bad magic" in str(r) for r in results)
    assert _status(manager) == {"a": "failed", "b": "loaded", "c": "unloaded"}
    assert factory.engines("a")[0].shutdowns == 1  # what the failed start built is freed
    assert manager.slots["a"].leases == 0 and manager.resident_bytes() == 100 << 20
    assert other.engine.health() == "serving"
    other.release()
    retried = await manager.acquire("a")  # the next request loads again
    assert retried.engine is factory.engines("a")[1] and _status(manager)["a"] == "loaded"
    retried.release()


async def test_keep_alive_zero_unloads_when_the_last_request_ends(three):
    manager, factory, _ = three
    first, second = await manager.acquire("a", 0), await manager.acquire("a", 0)
    first.release()
    await _settle()
    assert _status(manager)["a"] == "loaded"  # the second still holds it
    second.release()
    await _settle()
    assert _status(manager)["a"] == "unloaded" and factory.engines("a")[0].shutdowns == 1


async def test_idle_models_unload_after_their_keep_alive():
    manager, factory, clock = make_manager({"a": 100, "b": 100, "c": 100}, 300, idle_unload_after_s=300.0)
    await manager.start()
    (await manager.acquire("a")).release()  # the server's --idle-unload-after: 300 s
    (await manager.acquire("b", 30.0)).release()
    (await manager.acquire("c", math.inf)).release()  # a negative keep_alive: forever
    assert manager.slots["c"].expires_at is None and manager.slots["b"].expires_at == clock.now + 30
    clock.now += 29
    assert manager.reap(clock.now) == []
    clock.now += 2
    assert manager.reap(clock.now) == ["b"]
    clock.now += 300
    assert manager.reap(clock.now) == ["a"]
    clock.now += 10_000_000
    assert manager.reap(clock.now) == []
    await _settle()
    assert _status(manager) == {"a": "unloaded", "b": "unloaded", "c": "loaded"}
    assert [engine.shutdowns for engine in factory.built] == [1, 1, 0]
    await manager.shutdown()


async def test_a_request_resets_the_expiry(three):
    manager, _, clock = three
    (await manager.acquire("a", 60.0)).release()
    clock.now += 50
    lease = await manager.acquire("a", 60.0)
    clock.now += 50
    assert manager.reap(clock.now) == []  # held: no expiry while a request runs
    lease.release()
    clock.now += 59
    assert manager.reap(clock.now) == []
    clock.now += 2
    assert manager.reap(clock.now) == ["a"]


async def test_requests_waiting_for_one_load_are_bounded():
    manager, factory, _ = make_manager({"a": 10}, 100, max_waiting_per_model=2)
    await manager.start()
    factory.gates["a"] = gate = asyncio.Event()
    waiters = [asyncio.create_task(manager.acquire("a")) for _ in range(2)]
    await _settle()
    with pytest.raises(LoadQueueFullError, match="2 requests already wait"):
        await manager.acquire("a")
    gate.set()
    for lease in await asyncio.gather(*waiters):
        lease.release()
    (await manager.acquire("a")).release()  # loaded: no bound
    await manager.shutdown()


async def test_an_engine_that_dies_takes_only_its_model_down(three):
    manager, factory, _ = three
    (await manager.acquire("a")).release()
    (await manager.acquire("b")).release()
    factory.engines("a")[0].die(RuntimeError("child exited with SIGSEGV"))
    await _settle()
    assert _status(manager) == {"a": "failed", "b": "loaded", "c": "unloaded"}
    assert "SIGSEGV" in manager.slots["a"].last_error
    lease = await manager.acquire("a")  # loaded again
    assert lease.engine is factory.engines("a")[1]
    lease.release()


async def test_unknown_model(three):
    manager, _, _ = three
    with pytest.raises(UnknownModelError) as caught:
        await manager.acquire("nope")
    assert caught.value.known == ["a", "b", "c"]


async def test_drain_refuses_new_requests_and_shutdown_stops_every_engine(three):
    manager, factory, _ = three
    (await manager.acquire("a")).release()
    factory.gates["b"] = asyncio.Event()  # b is still loading at shutdown
    loading = asyncio.create_task(manager.acquire("b"))
    await _settle()
    await manager.drain(1.0)
    assert manager.health() == "draining" and factory.engines("a")[0].state == "draining"
    with pytest.raises(ManagerClosedError):
        await manager.acquire("a")
    await manager.shutdown()
    assert isinstance((await asyncio.gather(loading, return_exceptions=True))[0], ManagerClosedError)
    assert [engine.state for engine in factory.built] == ["stopped", "stopped"]
