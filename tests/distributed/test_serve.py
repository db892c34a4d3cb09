"""`metrale serve --tensor-parallel 2`: one command starts both ranks and serves from rank 0 (the engine
process, or the server's own with --no-engine-process); a rank that dies ends the open streams with an
error event; the engine process is then restarted with new ranks, while an in-process engine makes
/health answer 503 and the server exit 1; SIGTERM drains and stops every rank."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.server.serve import ServerProcess
from tests.metrale.model_helpers import write_tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _followers(server_pid: int) -> list[int]:
    """The follower ranks the server started (processes running metrale.distributed.follower whose
    parent is the server or its engine process)."""
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            processes[int(entry.name)] = (ppid, (entry / "cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    parents = {server_pid} | {pid for pid, (ppid, cmd) in processes.items()
                               if ppid == server_pid and b"metrale.engine.engine_process" in cmd}
    return [pid for pid, (ppid, cmd) in processes.items() if ppid in parents and b"metrale.distributed.follower" in cmd]


def _complete(server: ServerProcess, max_tokens: int, stream: bool):
    body = json.dumps({"prompt": [5, 30, 7, 60, 11], "max_tokens": max_tokens, "stream": stream,
                       "ignore_eos": True, "temperature": 0}).encode()
    status, raw = server.post("/v1/completions", body)
    if stream:
        return status, [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    return status, json.loads(raw)


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "in-process"])
def test_serve_with_two_ranks_and_a_rank_that_dies(tmp_path, engine_process):
    model = write_tiny_model(str(tmp_path / "tiny.gguf"), max_position_embeddings=512)
    mode = "--engine-process" if engine_process else "--no-engine-process"
    with ServerProcess("--model", model, "--tensor-parallel", "2", "--max-model-len", "512", "--kv-cache-mib", "8",
                       "--block-size", "4", "--dead-exit-grace", "3", mode) as server:
        (follower,) = _followers(server.proc.pid)
        status, body = _complete(server, 8, stream=False)
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        (info,) = [dict(labels) for name, labels in server.metrics() if name == "metrale_build_info"]
        assert info["tensor_parallel_size"] == "2"
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(_complete, server, 400, True) for _ in range(2)]
            server.wait_for(lambda s: s.gauges()[0] == 2, 30, "two running")
            os.kill(follower, signal.SIGKILL)
            for future in streams:
                status, events = future.result(timeout=30)
                assert status == 200 and events[-1] == "[DONE]"
                error = json.loads(events[-2])["error"]
                assert "rank 1" in error["message"] and "killed by signal 9" in error["message"], error
        if engine_process:  # the engine process restarts with new ranks; the server never stopped serving
            server.wait_for(lambda s: s.get("/health")[0] == 200 and len(_followers(s.proc.pid)) == 1, 120, "back")
            assert _followers(server.proc.pid) != [follower]
            status, body = _complete(server, 8, stream=False)
            assert status == 200 and body["usage"]["completion_tokens"] == 8
            assert server.metric("metrale_engine_restarts_total") == 1.0
            return
        assert server.get("/health")[0] == 503
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.proc.returncode == 1, server.logs()


def test_sigterm_drains_and_stops_every_rank(tmp_path):
    model = write_tiny_model(str(tmp_path / "tiny.gguf"), max_position_embeddings=512)
    with ServerProcess("--model", model, "--tensor-parallel", "2", "--max-model-len", "512", "--kv-cache-mib", "8",
                       "--block-size", "4") as server:
        (follower,) = _followers(server.proc.pid)
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_complete, server, 64, True)
            server.wait_for(lambda s: s.gauges()[0] == 1, 30, "one running")
            assert server.stop() == 0  # the drain lets the stream finish
            status, events = stream.result(timeout=30)
        assert status == 200 and events[-1] == "[DONE]" and "error" not in events[-2]
        assert follower not in _followers(server.proc.pid)  # and the no_orphans fixture checks it is gone
