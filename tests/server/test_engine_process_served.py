"""The engine process under a real `metrale serve` (its default) on a tiny model: kill -SEGV / SIGKILL of
the engine process under load ends every stream with an error event and [DONE] and every non-streamed
request with a 500 naming the death; the server keeps its port, restarts the engine and serves again;
an engine process stopped (SIGSTOP) is found hung, killed and restarted the same way; a spent restart
budget makes it exit 1."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.server.serve import ServerProcess

pytestmark = pytest.mark.timeout(240)
TINY = ("--max-model-len", "8192", "--kv-cache-mib", "64", "--block-size", "16")
LONG = 8000  # tokens: requests still running when the engine process is killed


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> str:
    from tests.metrale.model_helpers import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"), max_position_embeddings=8192)


def engine_pid(server: ServerProcess) -> int:
    """The pid of the server's engine process (a child running metrale.engine.engine_process)."""
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"metrale.engine.engine_process" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    raise AssertionError("no engine process under the server")


def complete(server: ServerProcess, max_tokens: int, stream: bool):
    body = json.dumps({"prompt": [5, 30, 7, 60, 11, 40, 9], "max_tokens": max_tokens, "stream": stream,
                       "ignore_eos": True, "temperature": 0}).encode()
    status, raw = server.post("/v1/completions", body, timeout_s=120)
    if stream:
        return status, [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    return status, json.loads(raw)


@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGKILL])
def test_a_killed_engine_process_costs_only_the_requests_in_flight(long_context_model, signum):
    with ServerProcess("--model", long_context_model, *TINY) as server:
        first = engine_pid(server)
        with ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(complete, server, LONG, True) for _ in range(4)]
            plain = [pool.submit(complete, server, LONG, False) for _ in range(2)]
            server.wait_for(lambda s: s.gauges()[0] == 6, 60, "six running")
            os.kill(first, signum)
            for future in streams:
                status, events = future.result()
                assert status == 200 and events[-1] == "[DONE]", events[-3:]
                error = json.loads(events[-2])["error"]
                assert "engine process died" in error["message"] and signal.Signals(signum).name in error["message"]
            for future in plain:
                status, body = future.result()
                assert status == 500 and "engine process died" in body["error"]["message"], body
        server.wait_for(lambda s: s.get("/health")[0] == 200, 120, "healthy again")
        assert engine_pid(server) != first
        assert complete(server, 8, False)[0] == 200
        assert server.metric("metrale_engine_restarts_total") == 1.0
        server.wait_for(lambda s: s.idle(), 30, "idle")


def test_a_hung_engine_process_is_killed_and_its_streams_end_with_an_error_event(long_context_model):
    env = {"METRALE_ENGINE_HANG_TIMEOUT_S": "2"}
    with ServerProcess("--model", long_context_model, *TINY, env=env) as server:
        first = engine_pid(server)
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(complete, server, LONG, True) for _ in range(2)]
            server.wait_for(lambda s: s.gauges()[0] == 2, 60, "two running")
            os.kill(first, signal.SIGSTOP)  # alive, silent: as if stuck in a native call
            for future in streams:
                status, events = future.result()
                assert status == 200 and events[-1] == "[DONE]", events[-3:]
                message = json.loads(events[-2])["error"]["message"]
                assert "engine process died (hung: no heartbeat for" in message, message
        server.wait_for(lambda s: s.get("/health")[0] == 200, 120, "healthy again")
        assert engine_pid(server) != first
        assert complete(server, 8, False)[0] == 200
        assert server.metric("metrale_engine_hangs_total") == 1.0
        assert server.metric("metrale_engine_restarts_total") == 1.0
        server.wait_for(lambda s: s.idle(), 30, "idle")


def test_a_spent_restart_budget_makes_the_server_exit_1(long_context_model):
    with ServerProcess("--model", long_context_model, *TINY, "--max-engine-restarts", "0", "--dead-exit-grace", "1") as server:
        os.kill(engine_pid(server), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.proc.returncode == 1, server.logs()
        assert "restart budget" in server.logs()
