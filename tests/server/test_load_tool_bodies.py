"""The exact request bodies (and headers) that load-testing tools send, served as they expect: guidellm 0.8.1's
(stream_options.continuous_usage_stats on every streamed request, stop: null, ignore_eos) and `vllm bench serve`'s
from vLLM 0.34 (vllm/benchmarks/lib/endpoint_request_func.py: repetition_penalty, logprobs: null, chat content as
parts, x-request-id). None of their fields may be unknown to metrale (each would be ignored), and the usage they
read must be there. guidellm itself was also run against `metrale serve` (README, "Load testing with other tools")."""

from __future__ import annotations

import pytest

from metrale.server.app import ServerApp
from tests.server.fakes import FakeEngine, call

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "the quick brown fox jumps over the lazy dog"
GUIDELLM_STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
CASES = {
    "guidellm completions": (COMPLETIONS, {"model": "fake-model", **GUIDELLM_STREAM, "max_tokens": 4, "stop": None,
                                           "ignore_eos": True, "prompt": PROMPT}, {}),
    "guidellm chat": (CHAT, {"model": "fake-model", **GUIDELLM_STREAM, "max_completion_tokens": 4, "stop": None,
                             "ignore_eos": True, "messages": [{"role": "user", "content": PROMPT}]}, {}),
    "vllm bench openai": (COMPLETIONS, {"model": "fake-model", "prompt": PROMPT, "repetition_penalty": 1.0,
                                        "max_tokens": 4, "logprobs": None, "stream": True,
                                        "stream_options": {"include_usage": True}, "ignore_eos": True,
                                        "temperature": 0.0}, {"x-request-id": "bench-1a2b3c4d-0"}),
    "vllm bench openai-chat": (CHAT, {"model": "fake-model", "messages": [{"role": "user", "content": [
        {"type": "text", "text": PROMPT}]}], "max_completion_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0},
        {"x-request-id": "bench-1a2b3c4d-1"}),
}


@pytest.mark.parametrize("case", CASES)
async def test_a_load_tools_body_is_served_with_the_usage_it_reads(case):
    path, body, headers = CASES[case]
    engine = FakeEngine()
    app = ServerApp(engine, manage_engine=False)
    r = await call(app, "POST", path, body, headers=headers)
    assert r.status == 200, r.body
    if "x-request-id" in headers:
        assert r.headers["x-request-id"] == headers["x-request-id"]
        assert engine.generated_ids[-1] == headers["x-request-id"]
    *chunks, last, done = r.events()
    assert done == "[DONE]" and last["choices"] == []
    assert last["usage"]["completion_tokens"] == 4 and last["usage"]["prompt_tokens"] > 0
    first = chunks[0]["choices"][0]
    if path == CHAT:  # the role goes out with the first token, so a client's TTFT is the first token's
        assert first["delta"]["role"] == "assistant" and chunks[1]["choices"][0]["delta"]["content"]
    if body["stream_options"].get("continuous_usage_stats"):
        assert all(chunk["usage"]["completion_tokens"] >= 1 for chunk in chunks)
    params = engine.submitted[-1][1]
    assert params.max_tokens == 4 and params.ignore_eos
    metrics = (await call(app, "GET", "/metrics")).body
    assert b"metrale_request_unknown_fields_total{model_name=\"fake-model\"} 0.0" in metrics
