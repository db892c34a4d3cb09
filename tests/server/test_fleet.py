"""Two real `metrale serve` replicas of a tiny model behind the real sglang-router, on 127.0.0.1.

- the router registers both under the served model id and routes a chat without "model";
- requests sharing a long system prompt land on one replica: its prefix-cache hit counter rises, the
  other's does not (cache_aware policy, as `metrale fleet` starts it);
- SIGKILL of a replica mid-load: new requests are answered by the survivor; the killed replica's
  in-flight clients end cleanly. "Clean", given what the router does (it cannot re-route a response
  that has started): every in-flight request ends promptly as a complete 200 (a request the router
  retried on the survivor), an HTTP 5xx with a JSON error body, or a stream cut at the transport level
  (the chunked body ends early, no `data: [DONE]`), which HTTP clients report as an error. Never a
  hang, never a stream that looks complete;
- `metrale fleet` itself: ready line per process, SIGTERM stops everything with status 0, and with
  no restarts left (--max-restarts 0) a replica that dies stops the rest with status 1 (its
  supervision: test_fleet_supervisor.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("sglang_router", reason="sglang-router is not installed: pip install 'metrale[router]'")
httpx = pytest.importorskip("httpx")

from metrale.cli import build_parser  # noqa: E402
from metrale.server.fleet import free_ports, router_command  # noqa: E402
from tests.server.fleet_helpers import FleetProcess, tiny_model, wait_gone  # noqa: E402, F401
from tests.server.serve import ServerProcess  # noqa: E402

pytestmark = [pytest.mark.router, pytest.mark.timeout(180)]

SERVED = "tiny"
SERVE_ARGS = ("--max-model-len", "1024", "--kv-cache-mib", "16", "--served-model-name", SERVED)
SYSTEM = ("You are a careful assistant for a small library. Answer questions about opening hours, "
          "borrowing rules, late fees and the reading room politely and briefly. ") * 3  # 471 chars, 390 tokens


def fleet_args(*argv: str):
    return build_parser().parse_args(["fleet", *argv])


def total(server: ServerProcess, name: str) -> float:
    """A counter summed over its label sets."""
    return sum(value for (sample, _), value in server.metrics().items() if sample == name)


def chat(system: str, user: str, **extra) -> dict:
    return {"model": SERVED, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 4, "temperature": 0, **extra}


class Router:
    """sglang-router started exactly as `metrale fleet` starts it."""

    def __init__(self, worker_urls: list[str], *flags: str) -> None:
        self.port, metrics_port = free_ports(2)
        args = fleet_args("--port", str(self.port), *flags)
        self.proc = subprocess.Popen(router_command(args, worker_urls, metrics_port), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/workers", timeout=5).json()["workers"]

    def wait_healthy(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if sum(w["is_healthy"] for w in self.workers()) == count:
                    return
            time.sleep(0.1)
        raise AssertionError(f"router not at {count} healthy workers in {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def cluster(tiny_model):
    """(router, [replica0, replica1]); the replicas start side by side."""
    with contextlib.ExitStack() as stack:
        servers = [ServerProcess("--model", tiny_model, "--model-alias", "unknown", *SERVE_ARGS) for _ in range(2)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = [pool.submit(stack.enter_context, server) for server in servers]
            for future in started:
                future.result()
        router = Router([s.url() for s in servers])
        stack.callback(router.stop)
        router.wait_healthy(2)
        yield router, servers


@pytest.fixture
def fleet_process():
    started: list[FleetProcess] = []

    def start(*argv: str, env: dict[str, str] | None = None) -> FleetProcess:
        started.append(FleetProcess(*argv, env=env))
        return started[-1]

    yield start
    for fleet in started:
        fleet.stop()


def test_fleet_command_serves_and_stops_on_sigterm(tiny_model, fleet_process):
    fleet = fleet_process("--replicas", "2", "--model", tiny_model, *SERVE_ARGS)
    pids = fleet.wait_ready(2)
    assert set(pids) == {"router", "replica-0", "replica-1"}
    body = chat(SYSTEM, "hello")
    del body["model"]
    response = httpx.post(f"http://127.0.0.1:{fleet.port}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200 and response.json()["model"] == SERVED, response.text
    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(60) == 0
    assert wait_gone(set(pids.values())) == set()


def test_fleet_out_of_restarts_stops_everything_when_a_replica_dies(tiny_model, fleet_process):
    fleet = fleet_process("--replicas", "1", "--max-restarts", "0", "--model", tiny_model, *SERVE_ARGS,
                          env={"METRALE_API_KEY": "k3y"})
    pids = fleet.wait_ready(1)
    url = f"http://127.0.0.1:{fleet.port}/v1/chat/completions"
    assert httpx.post(url, json=chat(SYSTEM, "hi"), timeout=30).status_code == 401  # refused by the router
    response = httpx.post(url, json=chat(SYSTEM, "hi"), headers={"Authorization": "Bearer k3y"}, timeout=30)
    assert response.status_code == 200, response.text
    os.kill(pids["replica-0"], signal.SIGKILL)
    assert fleet.proc.wait(60) == 1
    assert wait_gone(set(pids.values())) == set()
    fleet.wait_line(r"replica-0 \(pid \d+\) was killed by SIGKILL; replica-0 restarted 0 times in 300 s: giving up")


def test_router_registers_both_replicas_under_the_served_model_id(cluster):
    router, servers = cluster
    workers = {w["url"]: w for w in router.workers()}
    assert set(workers) == {s.url() for s in servers}
    for worker in workers.values():
        assert worker["model_id"] == SERVED and worker["is_healthy"]
        assert worker["metadata"]["model_type"] == "llama"
    assert [m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]] == [SERVED]


def test_chat_without_model_is_served_through_the_router(cluster):
    router, _ = cluster
    body = chat(SYSTEM, "hello")
    del body["model"]  # the router forwards "model": "unknown"; the replicas alias it
    response = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == SERVED


def test_shared_system_prompt_sticks_to_one_replica(cluster):
    router, servers = cluster
    system = "Group A. " + SYSTEM
    before = [(total(s, "metrale_prefix_cache_hits_total"), total(s, "metrale_request_success_total"))
              for s in servers]
    for i in range(4):
        response = httpx.post(router.url + "/v1/chat/completions", json=chat(system, f"question {i}"), timeout=30)
        assert response.status_code == 200, response.text
    after = [(total(s, "metrale_prefix_cache_hits_total"), total(s, "metrale_request_success_total"))
             for s in servers]
    hits = [a[0] - b[0] for a, b in zip(after, before)]
    served = [a[1] - b[1] for a, b in zip(after, before)]
    assert sorted(served) == [0, 4], served
    holder = served.index(4)
    assert hits[holder] >= 3 * 16 and hits[1 - holder] == 0, hits  # each repeat reuses whole blocks


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> str:
    """One streaming request's outcome: "complete", "http <status>", or "cut" (no [DONE])."""
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                error = json.loads(await response.aread())["error"]
                assert error["message"], error
                return f"http {response.status_code}"
            done = False
            async for line in response.aiter_lines():
                done = done or line == "data: [DONE]"
                assert '"error"' not in line, line  # a replica error event would also be clean, but none is expected
            return "complete" if done else "cut"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "cut"


async def _complete(client: httpx.AsyncClient, url: str, body: dict) -> str:
    response = await client.post(url, json=body)
    if response.status_code == 200:
        assert response.json()["choices"][0]["finish_reason"] == "length"
        return "complete"
    assert response.json()["error"], response.text
    return f"http {response.status_code}"


async def test_killing_a_replica_mid_load(cluster):
    """Runs last in this module: it leaves one replica dead."""
    router, servers = cluster
    url = router.url + "/v1/chat/completions"
    long = {"max_tokens": 500, "ignore_eos": True}  # several seconds each; prompt + 500 < max_model_len
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        # Distinct prompts: cache_aware places new prefixes on the replica with fewer requests in flight.
        tasks = [asyncio.create_task(_stream(client, url, {**chat(f"Session {i}. " + SYSTEM[::-1], "go"), **long,
                                                           "stream": True})) for i in range(4)]
        tasks += [asyncio.create_task(_complete(client, url, {**chat(f"Batch {i}. " + SYSTEM, "go"), **long}))
                  for i in range(2)]
        deadline = time.monotonic() + 30
        while not all(s.gauges()[0] >= 1 for s in servers):
            assert time.monotonic() < deadline, [s.gauges() for s in servers]
            assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
            await asyncio.sleep(0.05)
        victim, survivor = servers
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        # New requests right after the kill: answered (by the survivor, the only one alive).
        served_before = total(survivor, "metrale_request_success_total")
        for i in range(4):
            response = await client.post(url, json=chat(f"After {i}. " + SYSTEM, "hi"))
            assert response.status_code == 200, response.text
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    assert total(survivor, "metrale_request_success_total") - served_before >= 4
    assert set(outcomes) <= {"complete", "cut", "http 500", "http 502", "http 503"}, outcomes
    assert "cut" in outcomes[:4], outcomes  # the killed replica was streaming to someone
    assert outcomes.count("complete") >= 1, outcomes  # the survivor's own requests finished
    router.wait_healthy(1, timeout_s=30)  # health checks take the dead replica out of rotation
    assert [w["url"] for w in router.workers() if w["is_healthy"]] == [survivor.url()]
