"""What the load generator talks to: the in-process engine, or an OpenAI-compatible HTTP server.

A target turns one `BenchRequest` into an async iterator of `Chunk`s, one per piece of output the
client receives, and raises `TargetError` (or any exception) when the request fails, including an
error event in the middle of an SSE stream. Closing the iterator early cancels the request.

    target = EngineTarget(engine)                                   # in-process
    target = OpenAITarget("http://127.0.0.1:8000", endpoint="chat")  # HTTP, streaming SSE
    async with contextlib.aclosing(target.stream(request)) as chunks:
        async for chunk in chunks: ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from metrale.bench.workloads import BenchRequest


class TargetError(RuntimeError):
    """A request failed at the target: an HTTP error, an error event, a truncated stream."""


@dataclass(frozen=True)
class Chunk:
    """Output received at one moment. `num_tokens` is exact in-process; over HTTP each chunk counts
    as one until the final usage report (`completion_tokens`) gives the exact total."""

    num_tokens: int
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    token_ids: tuple[int, ...] = ()  # when the target knows them (in process)
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache, when it says


class Target(Protocol):
    """Anything the load generator can drive."""

    name: str

    def stream(self, request: BenchRequest) -> AsyncIterator[Chunk]:
        """The request's output as it arrives; raises on failure."""
        ...


class EngineTarget:
    """The in-process `AsyncEngine`: `generate` for prompts, `chat` for messages."""

    def __init__(self, engine: Any, *, temperature: float = 0.0, ignore_eos: bool = True,
                 name: str = "metrale") -> None:
        self.engine = engine
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.name = name

    async def stream(self, request: BenchRequest) -> AsyncIterator[Chunk]:
        from metrale import SamplingParams

        params = SamplingParams(max_tokens=request.output_len, temperature=self.temperature,
                                ignore_eos=self.ignore_eos)
        if request.messages is not None:
            stream = self.engine.chat(request.messages, params)
        else:
            stream = self.engine.generate(request.prompt, params)
        async with stream:
            async for out in stream:
                if out.finish_reason == "abort":
                    raise TargetError("the engine aborted the request")
                yield Chunk(len(out.token_ids), prompt_tokens=out.num_prompt_tokens, token_ids=tuple(out.token_ids),
                            cached_tokens=out.num_cached_tokens)


class OpenAITarget:
    """Streaming /v1/completions (prompts) or /v1/chat/completions (messages) over httpx.

    Asks for `stream_options.include_usage` to get exact token counts, and for vLLM's
    `ignore_eos` when set (metrale and vLLM read it; a server that rejects it needs ignore_eos=False).
    `model` None asks /v1/models for the first served model. Use as an async context manager.
    """

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 temperature: float = 0.0, ignore_eos: bool = True, timeout_s: float = 600.0,
                 name: str | None = None, transport: Any = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s
        self.name = name or self.base_url
        self.transport = transport  # an httpx transport (tests: httpx.MockTransport); None is the network
        self._client: Any = None

    async def __aenter__(self) -> "OpenAITarget":
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(self.timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None), transport=self.transport)
        if self.model is None:
            self.model = await self._first_model()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._client.aclose()

    async def _first_model(self) -> str:
        response = await self._client.get("/v1/models")
        if response.status_code != 200:
            raise TargetError(f"GET /v1/models: HTTP {response.status_code}: {response.text[:200]}")
        models = response.json().get("data") or []
        if not models:
            raise TargetError("GET /v1/models lists no model; pass one with --served-model")
        return models[0]["id"]

    def body(self, request: BenchRequest) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of the streaming request."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.output_len,
                                "temperature": self.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if request.messages is not None:
            return "/v1/chat/completions", {**body, "messages": request.messages}
        return "/v1/completions", {**body, "prompt": request.prompt}

    async def stream(self, request: BenchRequest) -> AsyncIterator[Chunk]:
        if self._client is None:
            raise RuntimeError("use OpenAITarget as `async with OpenAITarget(...) as target`")
        path, body = self.body(request)
        async with self._client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise TargetError(f"HTTP {response.status_code}: {text[:300]}")
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                chunk = parse_event(json.loads(payload))
                if chunk is not None:
                    yield chunk
            if not done:
                raise TargetError("the stream ended without data: [DONE]")


def parse_event(event: dict[str, Any]) -> Chunk | None:
    """One SSE event of a completion or chat completion stream; raises TargetError on an error event."""
    if "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise TargetError(f"error event mid-stream: {message}")
    usage = event.get("usage") or {}
    has_text = False
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        has_text = has_text or bool(delta.get("content") if isinstance(delta, dict) else choice.get("text"))
    if not (usage or has_text):
        return None
    # llama-server puts usage on the last choice event; under load it may carry text too (merged tokens)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")  # OpenAI's field; vLLM and metrale fill it
    return Chunk(1 if has_text else 0, prompt_tokens=usage.get("prompt_tokens"),
                 completion_tokens=usage.get("completion_tokens"), cached_tokens=cached)
