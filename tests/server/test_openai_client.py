"""The official openai client against a real `metrale serve` (real engine, default model) on loopback:
completions and chat, streaming and not, usage, errors, metric counts, aborts and disconnects."""

from __future__ import annotations

import asyncio
import json
import socket

import openai
import pytest

from tests.server.serve import SMALL, ServerProcess

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(*SMALL, "--max-num-seqs", "8") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120) as client:
        yield client  # closed with the module: no connection is left for the garbage collector


@pytest.fixture(scope="module")
def model(client) -> str:
    (card,) = client.models.list().data
    return card.id


def test_health_and_models(server, model):
    assert server.get("/health") == (200, b'{"status":"serving"}')
    assert model and server.get("/v1/models")[0] == 200


def test_completion_stream_matches_non_stream(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    (choice,) = full.choices
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 6 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 6
    chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *deltas, usage = chunks
    assert "".join(c.choices[0].text for c in deltas) == choice.text
    assert [c.choices[0].finish_reason for c in deltas].count("length") == 1
    assert deltas[-1].choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.model_dump() == full.usage.model_dump()
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_matches_non_stream(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    (choice,) = full.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, logprobs=2, **GREEDY)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert all(lp <= 0 for lp in logprobs.token_logprobs) and all(len(t) <= 2 for t in logprobs.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(max(top.values()) == pytest.approx(lp, abs=1e-4)
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    chat = client.chat.completions.create(model=model, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_stop_finish_reason(client, model):
    out = client.completions.create(model=model, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12, stop=[","])
    assert out.choices[0].finish_reason == "stop" and "," not in out.choices[0].text


def test_errors_map_to_openai_exceptions(client, model):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt=PROMPT, temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match=r"max_model_len \(512\)"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=600)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=model, messages=[{"role": "user"}, {"content": "x"}])


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


async def test_metric_counts_n_requests_of_m_tokens(server, model):
    n, m = 4, 5
    client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    before = server.metrics()
    outs = await asyncio.gather(*(client.completions.create(
        model=model, prompt=f"{PROMPT} number {i}", max_tokens=m, temperature=0,
        extra_body={"ignore_eos": True}) for i in range(n)))
    await client.close()
    after = server.metrics()
    assert all(o.usage.completion_tokens == m for o in outs)
    assert _delta(before, after, "metrale_time_to_first_token_seconds_count") == n
    assert _delta(before, after, "metrale_inter_token_latency_seconds_count") == n * (m - 1)
    assert _delta(before, after, "metrale_generation_tokens_total") == n * m
    assert _delta(before, after, "metrale_request_success_total", finished_reason="length") == n
    assert _delta(before, after, "metrale_prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert _delta(before, after, "metrale_e2e_request_latency_seconds_count") == n
    assert server.idle()


async def test_aborting_everything_returns_gauges_to_zero(server, model):
    client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    aborted_before = server.metric("metrale_request_success_total", finished_reason="abort")

    async def consume(i: int) -> None:
        stream = await client.completions.create(model=model, prompt=f"Story {i}:", max_tokens=400,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            pass

    tasks = [asyncio.create_task(consume(i)) for i in range(10)]  # 8 run, 2 wait
    await asyncio.to_thread(server.wait_for, lambda s: s.gauges()[0] == 8 and s.gauges()[1] == 2
                            and s.gauges()[2] > 0, 30, "8 running and 2 waiting")
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()  # closes the connections: the server sees the disconnects
    await asyncio.to_thread(server.wait_for, lambda s: s.idle(), 60, "idle after aborts")
    assert server.metric("metrale_request_success_total", finished_reason="abort") - aborted_before == 10


def _raw_request(server: ServerProcess, payload: dict) -> socket.socket:
    body = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_blocks(server, stream):
    aborted_before = server.metric("metrale_request_success_total", finished_reason="abort")
    sock = _raw_request(server, {"prompt": PROMPT, "max_tokens": 400, "stream": stream, "ignore_eos": True})
    try:
        if stream:
            received = b""
            while received.count(b"data: ") < 3:  # mid-stream
                chunk = sock.recv(65536)
                assert chunk, f"the server closed the connection: {received[:300]!r}"
                received += chunk
        else:
            server.wait_for(lambda s: s.gauges()[0] == 1 and s.gauges()[2] > 0, 30, "request running")
    finally:
        sock.close()  # the disconnect
    server.wait_for(lambda s: s.idle(), 60, "blocks freed after disconnect")
    # aborted, not run to its 400 tokens: the disconnect was noticed (counted, not timed)
    assert server.metric("metrale_request_success_total", finished_reason="abort") - aborted_before == 1


def test_n_choices_and_cached_tokens_through_the_client(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, n=3, **GREEDY)
    assert [c.index for c in full.choices] == [0, 1, 2] and len({c.text for c in full.choices}) == 1
    assert full.usage.completion_tokens == 18
    again = client.completions.create(model=model, prompt=PROMPT * 8, **GREEDY)
    again = client.completions.create(model=model, prompt=PROMPT * 8, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    stream = client.chat.completions.create(model=model, messages=MESSAGES, n=2, stream=True, **GREEDY)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] and texts[0]


def test_a_list_of_prompts_as_the_openai_client_sends_it(client, model):
    """OpenAI's batch form (LangChain's `OpenAI().batch()` sends it): choice i is prompt i, each the text that prompt
    gets alone; usage sums the prompts."""
    prompts = [f"{PROMPT} one", f"{PROMPT} and a second, longer one"]
    alone = [client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0) for p in prompts]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
