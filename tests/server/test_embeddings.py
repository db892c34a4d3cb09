"""POST /v1/embeddings and Ollama's /api/embed, /api/embeddings, in process over a tiny real engine (random llama,
max_model_len 512): the response shapes, base64 = the float32 bytes of the floats, the limits (each a 400 that
queues nothing), the task a server runs, and a disconnect that aborts every input and frees its blocks. The
official clients against `metrale serve --task embed`: test_embeddings_client.py."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import threading

import msgspec
import pytest

from metrale.engine import submission
from metrale.pooling_params import MAX_EMBED_INPUTS
from metrale.server.app import ServerApp
from tests.server.fakes import call
from tests.server.tiny_engine import clean, engine  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
PATH = "/v1/embeddings"


@pytest.fixture
def app(engine):  # noqa: F811
    return ServerApp(engine, manage_engine=False, task="embed")


async def test_float_vectors_with_usage(app, engine):  # noqa: F811
    r = await call(app, "POST", PATH, {"model": engine.model_name, "input": ["hello there", "a b c"], "user": "u1"})
    assert r.status == 200
    body = r.json()
    assert body["object"] == "list" and body["model"] == engine.model_name
    assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {"embedding"}
    for d in body["data"]:
        assert len(d["embedding"]) == 64 and math.isclose(sum(x * x for x in d["embedding"]), 1.0, rel_tol=1e-5)
    counted = [len(await engine.prompt_token_ids(text)) for text in ("hello there", "a b c")]
    assert body["usage"] == {"prompt_tokens": sum(counted), "total_tokens": sum(counted)}
    await clean(engine)


@pytest.mark.parametrize("value", ["hello", [5, 6, 7], [[5, 6, 7], [8, 9]], ["x", "yz"]])
async def test_every_input_form(app, engine, value):  # noqa: F811
    r = await call(app, "POST", PATH, {"input": value})
    assert r.status == 200
    assert len(r.json()["data"]) == (1 if isinstance(value, str) or isinstance(value[0], int) else len(value))


async def test_base64_is_the_little_endian_float32_bytes_of_the_floats(app, engine):  # noqa: F811
    floats = (await call(app, "POST", PATH, {"input": [[5, 6, 7], [9]]})).json()["data"]
    packed = (await call(app, "POST", PATH, {"input": [[5, 6, 7], [9]], "encoding_format": "base64"})).json()["data"]
    for f, b in zip(floats, packed):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["embedding"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [[5]] * (MAX_EMBED_INPUTS + 1)}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[5], []]}, "input"),
    ({"input": [[5, 6], [5, 10**6]]}, "input"),
    ({"input": [[5, 6], [-1]]}, "input"),
    ({"input": [5] * 600}, "input"),  # max_model_len 512
    ({"input": "x", "dimensions": 8}, "dimensions"),  # the tiny model is not Matryoshka-trained
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": 5}, "input"),
    ({"input": [1.5]}, "input"),
])
async def test_bad_input_is_a_400_that_queues_nothing(app, engine, body, param):  # noqa: F811
    finished = engine.stats().requests_finished
    r = await call(app, "POST", PATH, body)
    assert r.status == 400 and r.json()["error"]["param"] == param, r.body
    assert engine.stats().requests_finished == finished
    await clean(engine)


async def test_truncate_prompt_tokens_admits_a_long_input(app, engine):  # noqa: F811
    r = await call(app, "POST", PATH, {"input": [5] * 600, "truncate_prompt_tokens": 100})
    assert r.status == 200 and r.json()["usage"]["prompt_tokens"] == 100


async def test_an_unknown_model_is_a_404(app):
    r = await call(app, "POST", PATH, {"input": "x", "model": "other"})
    assert r.status == 404 and r.json()["error"]["param"] == "model"


async def test_each_task_refuses_the_other_tasks_routes(engine):  # noqa: F811
    generate, embed = ServerApp(engine, manage_engine=False), ServerApp(engine, manage_engine=False, task="embed")
    r = await call(generate, "POST", PATH, {"input": "x"})
    assert r.status == 400 and "runs task generate; /v1/embeddings needs a server started with --task embed" \
        in r.json()["error"]["message"]
    r = await call(embed, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert r.status == 400 and "runs task embed" in r.json()["error"]["message"]
    r = await call(embed, "POST", "/api/chat", {"model": engine.model_name, "messages": []})
    assert r.status == 400 and "--task generate" in r.json()["error"]
    r = await call(embed, "POST", "/api/show", {"model": engine.model_name})
    assert r.json()["capabilities"] == ["embedding"]


async def test_ollama_embed_and_the_legacy_route(app, engine):  # noqa: F811
    r = await call(app, "POST", "/api/embed", {"model": engine.model_name, "input": ["a b", "c"], "keep_alive": "5m",
                                               "options": {"num_ctx": 64}})
    body = r.json()
    assert r.status == 200 and body["model"] == engine.model_name and len(body["embeddings"]) == 2
    assert body["prompt_eval_count"] > 0 and body["total_duration"] > 0 and body["load_duration"] == 0
    assert math.isclose(sum(x * x for x in body["embeddings"][0]), 1.0, rel_tol=1e-5)
    legacy = (await call(app, "POST", "/api/embeddings", {"model": engine.model_name, "prompt": "a b"})).json()
    norm = math.sqrt(sum(x * x for x in legacy["embedding"]))  # Ollama's legacy route does not normalise
    assert [x / norm for x in legacy["embedding"]] == pytest.approx(body["embeddings"][0], abs=1e-6)
    empty = (await call(app, "POST", "/api/embed", {"model": engine.model_name, "input": []})).json()
    assert empty["embeddings"] == []


async def test_ollama_truncate(app, engine):  # noqa: F811
    long = "a " * 700
    r = await call(app, "POST", "/api/embed", {"model": engine.model_name, "input": long})
    assert r.status == 200 and r.json()["prompt_eval_count"] == engine.max_model_len - 1
    r = await call(app, "POST", "/api/embed", {"model": engine.model_name, "input": long, "truncate": False})
    assert r.status == 400 and "at most" in r.json()["error"]
    await clean(engine)


async def test_ollama_truncate_keeps_the_start_of_a_text_longer_than_the_context_can_hold(app, engine):  # noqa: F811
    words = " ".join(f"w{i % 97}" for i in range(engine.max_model_len * 40))  # beyond what max_model_len tokens hold
    assert len(words) > engine._submission.inputs.max_prompt_chars
    r = await call(app, "POST", "/api/embed", {"model": engine.model_name, "input": words})
    assert r.status == 200 and r.json()["prompt_eval_count"] == engine.max_model_len - 1
    start = engine.tokenizer.encode(words, add_special_tokens=True)[:engine.max_model_len - 1]
    whole = (await call(app, "POST", PATH, {"input": start})).json()["data"][0]["embedding"]
    assert r.json()["embeddings"][0] == pytest.approx(whole, abs=1e-5)  # Ollama keeps the start
    await clean(engine)


async def test_truncate_prompt_tokens_keeps_the_end_of_a_text_longer_than_the_context_can_hold(app, engine):  # noqa: F811
    words = " ".join(f"w{i % 89}" for i in range(engine.max_model_len * 40))
    assert len(words) > engine._submission.inputs.max_prompt_chars  # refused before: it cannot fit untruncated
    r = await call(app, "POST", PATH, {"input": words, "truncate_prompt_tokens": -1})
    assert r.status == 200 and r.json()["usage"]["prompt_tokens"] == engine.max_model_len - 1
    end = engine.tokenizer.encode(words, add_special_tokens=True)[-(engine.max_model_len - 1):]
    whole = (await call(app, "POST", PATH, {"input": end})).json()["data"][0]["embedding"]
    assert r.json()["data"][0]["embedding"] == pytest.approx(whole, abs=1e-5)
    r = await call(app, "POST", PATH, {"input": words})
    assert r.status == 400 and "cannot fit in max_model_len tokens" in r.json()["error"]["message"]
    await clean(engine)


def record_encode_threads(engine, monkeypatch) -> list[str]:
    """The names of the threads the engine's tokenizer encodes on, in call order (filled as it runs)."""
    threads: list[str] = []
    real_encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode",
                        lambda *a, **k: threads.append(threading.current_thread().name) or real_encode(*a, **k))
    return threads


async def test_ollama_embed_tokenizes_many_inputs_on_the_tokenize_thread(app, engine, monkeypatch):  # noqa: F811
    threads = record_encode_threads(engine, monkeypatch)
    texts = [f"text {i} " + "lorem ipsum " * 50 for i in range(40)]  # > OFF_LOOP_PROMPT_CHARS in all, each short
    assert sum(map(len, texts)) > submission.OFF_LOOP_PROMPT_CHARS
    r = await call(app, "POST", "/api/embed", {"model": engine.model_name, "input": texts})
    assert r.status == 200 and len(r.json()["embeddings"]) == 40
    assert len(threads) == 40 and {t.rsplit("_", 1)[0] for t in threads} == {"metrale-tokenize"}
    await clean(engine)


async def test_ollama_embed_bounds_the_input_count_before_any_work(app, engine, monkeypatch):  # noqa: F811
    threads = record_encode_threads(engine, monkeypatch)
    steps = engine.stats().num_steps
    r = await call(app, "POST", "/api/embed", {"model": engine.model_name, "input": ["x"] * (MAX_EMBED_INPUTS + 1)})
    assert r.status == 400 and f"at most {MAX_EMBED_INPUTS} inputs" in r.json()["error"]
    assert threads == [] and engine.stats().num_steps == steps


async def test_ollama_embed_bad_dimensions_is_a_400_that_queues_nothing(app, engine):  # noqa: F811
    steps = engine.stats().num_steps
    r = await call(app, "POST", "/api/embed", {"model": engine.model_name, "input": "x", "dimensions": 0})
    assert r.status == 400 and "dimensions must be an int >= 1" in r.json()["error"]
    assert engine.stats().num_steps == steps


async def test_a_disconnect_aborts_every_input_and_frees_its_blocks(app, engine):  # noqa: F811
    raw = msgspec.json.encode({"input": [[5 + i % 50] * 400 for i in range(64)]})
    scope = {"type": "http", "method": "POST", "path": PATH,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    sent: list[dict] = []
    steps = engine.stats().num_steps
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        while engine.stats().num_steps < steps + 2:  # the client leaves once the inputs are being computed
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    assert sent == []  # nothing answered to a client that left
    await clean(engine)
