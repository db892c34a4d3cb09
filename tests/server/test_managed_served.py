"""Several real models behind one real `metrale serve` (engine processes on, its default): the default model and a
random tiny GGUF load on their first request, each in its own engine process; keep_alive 0 unloads a model and
its engine process exits; a corrupt file answers 503 with the loader's message while the others keep serving;
the `ollama` client lists the models and the resident ones; /metrics stays promtool-clean with two engines."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from contextlib import closing
from pathlib import Path

import ollama
import pytest

from metrale.loading.default_model import default_model_path
from tests.server.serve import ServerProcess

pytestmark = [pytest.mark.timeout(300), pytest.mark.real_model]
ARGS = ("--max-model-len", "512", "--kv-cache-mib", "16", "--max-resident-bytes", "1G")


def engine_pids(server: ServerProcess) -> set[int]:
    """The server's engine processes (children running metrale.engine.engine_process)."""
    pids = set()
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                if b"metrale.engine.engine_process" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.add(int(pid))
            except FileNotFoundError:
                pass  # exited between the listing and the read
    return pids


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached in {timeout_s} s")


def complete(server: ServerProcess, model: str) -> tuple[int, dict]:
    return server.post_json("/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4,
                                                "temperature": 0}, timeout_s=240)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model) -> Path:
    folder = tmp_path_factory.mktemp("models")
    (folder / "smol.gguf").symlink_to(default_model_path())
    (folder / "tiny.gguf").symlink_to(tiny_model)
    (folder / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 60)  # a header that is not one
    return folder


def test_models_load_on_demand_unload_and_fail_alone(models):
    with ServerProcess("--models", str(models), *ARGS) as server:
        cards = {card["id"]: card for card in _json(server.get("/v1/models"))["data"]}
        assert {name: card["status"] for name, card in cards.items()} == {
            "broken": "unloaded", "smol": "unloaded", "tiny": "unloaded"}
        assert cards["smol"]["size"] == default_model_path().stat().st_size
        assert engine_pids(server) == set()  # nothing is loaded before a request asks

        assert complete(server, "tiny")[0] == 200
        (tiny_pid,) = engine_pids(server)
        status, body = complete(server, "smol")
        assert status == 200 and body["model"] == "smol"
        assert len(engine_pids(server)) == 2

        status, body = complete(server, "broken")
        assert status == 503 and body["error"]["code"] == "model_load_failed"
        assert "broken" in body["error"]["message"] and len(body["error"]["message"]) > 40
        wait_until(lambda: len(engine_pids(server)) == 2, 60, "the failed load's engine process exit")
        assert complete(server, "smol")[0] == 200 and complete(server, "tiny")[0] == 200
        assert _json(server.get("/v1/models/broken"))["status"] == "failed"

        with closing(ollama.Client(host=server.url(""), timeout=240)) as client:
            assert sorted(m.model for m in client.list().models) == ["broken", "smol", "tiny"]
            assert sorted(m.model for m in client.ps().models) == ["smol", "tiny"]
            answer = client.generate(model="tiny", prompt="Hi", keep_alive=0, options={"num_predict": 2})
            assert answer.done
            wait_until(lambda: tiny_pid not in engine_pids(server), 60, "the unloaded model's engine process exit")
            assert [m.model for m in client.ps().models] == ["smol"]
        # the engine process exits before the manager finishes the unload: on a busy machine the card can
        # still say "unloading" for a moment after the exit
        wait_until(lambda: _json(server.get("/v1/models/tiny"))["status"] == "unloaded", 60, "tiny's card unloaded")
        assert complete(server, "tiny")[0] == 200  # loaded again, in a new engine process
        assert len(engine_pids(server)) == 2 and tiny_pid not in engine_pids(server)

        status, metrics = server.get("/metrics")
        assert status == 200 and b'metrale_requests_running{model_name="smol"}' in metrics
        if shutil.which("promtool") is not None:
            result = subprocess.run(["promtool", "check", "metrics"], input=metrics, capture_output=True, timeout=60)
            assert result.returncode == 0, result.stdout + result.stderr
    assert server.proc.returncode == 0


def _json(response: tuple[int, bytes]) -> dict:
    status, body = response
    assert status == 200, body
    return json.loads(body)
