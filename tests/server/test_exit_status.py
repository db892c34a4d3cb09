"""`metrale serve` with the kernels loaded exits 0 on SIGTERM and on SIGINT, with the engine in its own
process and in the server's, after a completion ran: no native abort at exit
(tests/metrale/engine/test_mlx_thread.py has the cause that once made ~1 exit in 20 abort)."""

from __future__ import annotations

import json
import signal

import pytest

from tests.server.serve import SMALL, ServerProcess

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]


@pytest.mark.parametrize("engine_process", ["--engine-process", "--no-engine-process"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_after_a_completion_exits_zero(sig, engine_process):
    with ServerProcess(*SMALL, engine_process) as server:
        status, body = server.post("/v1/completions", b'{"prompt": "Hello", "max_tokens": 4}')
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] >= 1
        server.proc.send_signal(sig)
        assert server.proc.wait(120) == 0, server.logs()[-3000:]
        assert "terminate called" not in server.logs()
