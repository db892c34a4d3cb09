"""Faults through a real `metrale serve` on a tiny model: failpoints over HTTP, a dead engine exits
non-zero, a second SIGTERM forces the exit with error events, slow headers are cut."""

from __future__ import annotations

import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.serve import ServerProcess

pytestmark = pytest.mark.timeout(180)
TINY = ("--max-model-len", "256", "--kv-cache-mib", "8", "--block-size", "4")


def tiny_server(model: str, *args: str, failpoints: str = "") -> ServerProcess:
    return ServerProcess("--model", model, *TINY, *args, env={"METRALE_FAILPOINTS": failpoints})


def complete(server: ServerProcess, max_tokens: int = 8, stream: bool = False, request_id: str | None = None):
    body = json.dumps({"prompt": [5, 30, 7, 60, 11, 40, 9], "max_tokens": max_tokens, "stream": stream,
                       "ignore_eos": True, "temperature": 0}).encode()
    status, raw = server.post("/v1/completions", body, headers={"x-request-id": request_id} if request_id else None)
    if stream:
        return status, [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    return status, json.loads(raw)


def test_a_failpoint_victim_fails_alone_over_http(tiny_model):
    with tiny_server(tiny_model, failpoints="detokenize=@victim,deliver=@victim-stream") as server:
        with ThreadPoolExecutor(6) as pool:
            victim = pool.submit(complete, server, 8, False, "victim")
            victim_stream = pool.submit(complete, server, 8, True, "victim-stream")
            others = [pool.submit(complete, server) for _ in range(4)]
            status, body = victim.result()
            assert status == 500 and body["error"]["code"] == "request_failed"
            status, events = victim_stream.result()
            assert status == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_failed"
            assert [f.result()[0] for f in others] == [200] * 4
        server.wait_for(lambda s: s.idle(), 60, "idle")
        assert server.get("/health")[0] == 200
        assert complete(server)[0] == 200


def test_random_faults_over_http_end_every_request(tiny_model):
    spec = ",".join(f"{p}=0.05" for p in ("schedule", "execute", "sample", "detokenize", "deliver"))
    with tiny_server(tiny_model, failpoints=spec) as server:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: complete(server, 6, i % 2 == 0), range(40)))
        for status, body in results:  # every request ended: a 200 with [DONE], or a clean 500
            assert status in (200, 500), (status, body)
            if isinstance(body, list):
                assert body[-1] == "[DONE]"
        assert any(status == 200 for status, _ in results)
        server.wait_for(lambda s: s.idle(), 60, "idle")
        assert server.get("/health")[0] == 200


def test_a_dead_engine_makes_the_server_exit_non_zero(tiny_model):
    with tiny_server(tiny_model, "--dead-exit-grace", "1", failpoints="execute=1.0") as server:
        for _ in range(3):  # three steps in a row in which every request fails: the engine gives up
            assert complete(server)[0] == 500
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.proc.returncode == 1, server.logs()
        assert "engine died" in server.logs()


def test_a_second_sigterm_forces_the_exit_with_error_events(tiny_model):
    with ServerProcess("--model", tiny_model, "--max-model-len", "512", "--kv-cache-mib", "8", "--block-size", "4",
                       "--shutdown-timeout", "60") as server:
        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(complete, server, 500, True) for _ in range(3)]  # seconds of steps
            server.wait_for(lambda s: s.gauges()[0] == 3, 30, "three running")
            server.proc.send_signal(signal.SIGTERM)
            # the second signal only once the first is handled (a signal pending twice is delivered once)
            server.wait_for(lambda s: "draining for up to" in s.logs(), 30, "the first SIGTERM handled")
            server.proc.send_signal(signal.SIGTERM)
            for future in streams:
                status, events = future.result()
                assert status == 200 and events[-1] == "[DONE]"
                assert json.loads(events[-2])["error"]["code"] == "aborted"
        assert server.proc.wait(30) == 1
        assert server.logs().count("forced exit") == 1


def test_a_client_that_trickles_its_headers_is_cut_off(tiny_model):
    with tiny_server(tiny_model, "--header-timeout", "1") as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            deadline = time.monotonic() + 60  # a hang guard: the server cuts it after --header-timeout (1 s)
            closed = False
            while time.monotonic() < deadline:
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                    if sock.recv(1024, socket.MSG_DONTWAIT) == b"":
                        closed = True
                        break
                except BlockingIOError:
                    pass
                except OSError:
                    closed = True
                    break
                time.sleep(0.3)
            assert closed
        assert server.get("/health")[0] == 200  # the server itself is fine


def test_a_chat_without_max_tokens_uses_the_rest_of_a_small_context(tiny_model):
    with ServerProcess("--model", tiny_model, "--max-model-len", "48", "--kv-cache-mib", "8", "--block-size", "4") as server:
        status, body = server.post_json("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "temperature": 0})
        assert status == 200, body
        usage = body["usage"]
        assert body["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 48
