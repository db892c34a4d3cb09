"""Unit-test doubles: a scripted engine behind the real RequestStream, and an in-process ASGI client.

Used only for response-shape and error-mapping tests; the behaviour tests run the real engine in a
real `metrale serve` process (test_openai_client.py and friends).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest

from metrale.text.chat_template import validate_messages
from metrale.errors import EngineDrainingError, PromptTooLongError
from metrale.engine.metrics import EngineMetrics
from metrale.outputs import EngineInfo, EngineStats, RequestOutput
from metrale.sampling_params import SamplingParams
from metrale.engine.stream import GroupStream, OutputChannel, RequestStream


class FakeEngine:
    """A metrale.engine.protocol.EngineClient that emits `words` (one per 'step', `step_s` apart) up to max_tokens, then finishes with "length".

    `fail_after` makes a request fail after that many tokens; `reject` makes submission raise.
    """

    def __init__(self, words: tuple[str, ...] = ("Hello", " world", "!", " How", " are", " you"),
                 step_s: float = 0.0, max_model_len: int = 64) -> None:
        self.words = words
        self.step_s = step_s
        self.max_model_len = max_model_len
        self.model_name = "fake-model"
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, model_name=self.model_name)
        self.state = "serving"
        self.fail_after: int | None = None
        self.reject: Exception | None = None
        self.submitted: list[tuple[Any, SamplingParams]] = []
        self.aborted: list[str] = []
        self.live: dict[str, asyncio.Task] = {}
        self.tool_call_format: str | None = None
        self.reasoning_format: str | None = None
        self.sampling_defaults: dict[str, Any] = {}
        self.prepared: list[SamplingParams] = []
        self.chat_tools: list = []
        self.template_kwargs: list[dict] = []
        self.generated_ids: list[str | None] = []

    def health(self) -> str:
        return self.state

    def stats(self) -> EngineStats:
        return EngineStats(health=self.state, running=len(self.live), waiting=0, kv_blocks_total=0, kv_blocks_free=0,
                           kv_usage=0.0, peak_kv_usage=0.0, num_preemptions=0, num_steps=0, prefix_cache_queries=0,
                           prefix_cache_hits=0, requests_finished=0)

    def info(self) -> EngineInfo:
        return EngineInfo(model_path="/models/fake-model.gguf", model_type="llama", dtype="float32", kv_block_size=16)

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in token_ids)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in token_ids]

    def record_rejected(self, reason: str) -> None:
        self.metrics.record_rejected(reason)

    def metrics_exposition(self) -> bytes:
        return generate_latest(self.registry)

    def generate(self, prompt: Any, params: SamplingParams, *, request_id: str | None = None,
                 priority: int = 0, lora: str | None = None) -> RequestStream:
        if self.state == "draining":
            raise EngineDrainingError("draining")
        if self.reject is not None:
            raise self.reject
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise PromptTooLongError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) "
                                     f"exceeds max_model_len ({self.max_model_len})")
        self.submitted.append((prompt, params))
        self.generated_ids.append(request_id)
        if params.n > 1:  # one scripted sequence per index, under ids id, id#1, ...
            ids = [request_id, *(f"{request_id}#{i}" for i in range(1, params.n))]
            channels = [OutputChannel(rid) for rid in ids]
            for channel in channels:
                self.live[channel.request_id] = asyncio.get_running_loop().create_task(
                    self._run(channel, max_tokens, n_prompt))
            return GroupStream(channels, lambda channel: self.abort(channel.request_id))
        channel = OutputChannel(request_id)
        self.live[request_id] = asyncio.get_running_loop().create_task(self._run(channel, max_tokens, n_prompt))
        return RequestStream(channel, self.abort)

    async def prepare(self, params: SamplingParams) -> None:
        self.prepared.append(params)

    def chat(self, messages: list[dict], params: SamplingParams, *, request_id: str | None = None,
             priority: int = 0, tools: list | None = None, lora: str | None = None) -> RequestStream:
        self.chat_tools.append(tools)
        checked = validate_messages(messages)  # the real engine's check
        return self.generate(" ".join(m["content"] for m in checked), params, request_id=request_id)

    def list_loras(self) -> dict[str, str]:
        return {}

    def abort(self, request_id: str) -> bool:
        task = self.live.pop(request_id, None)
        if task is None:
            return False
        self.aborted.append(request_id)
        task.cancel()
        return True

    def abort_all(self) -> None:
        for request_id in list(self.live):
            self.abort(request_id)

    async def prompt_token_ids(self, prompt: Any) -> Any:
        return prompt  # the fake "tokenizes" into the prompt itself: generate takes either

    async def chat_token_ids(self, messages: list[dict], tools: list | None = None, **template_kwargs: Any) -> str:
        self.chat_tools.append(tools)
        self.template_kwargs.append(template_kwargs)
        checked = validate_messages(messages)  # the real engine's check
        return " ".join(m["content"] for m in checked)

    async def wait_until_dead(self) -> BaseException | None:
        await asyncio.Event().wait()  # the fake never dies
        return None

    async def _run(self, channel: OutputChannel, max_tokens: int, n_prompt: int) -> None:
        try:
            for i in range(max_tokens):
                await asyncio.sleep(self.step_s)
                if self.fail_after is not None and i == self.fail_after:
                    channel.put(_out(channel, [], "", "error", n_prompt, i), error=RuntimeError("boom"))
                    return
                last = i == max_tokens - 1
                channel.put(_out(channel, [i], self.words[i % len(self.words)], "length" if last else None,
                                 n_prompt, i + 1))
        except asyncio.CancelledError:
            channel.put(_out(channel, [], "", "abort", n_prompt, 0))
            raise
        finally:
            self.live.pop(channel.request_id, None)

    async def drain(self, timeout_s: float) -> None:
        self.state = "draining"

    async def start(self) -> None:
        self.state = "serving"

    async def shutdown(self) -> None:
        self.state = "stopped"



class WordEngine(FakeEngine):
    """The scripted engine with a tokenizer for chat: one token per word of the rendered messages."""

    async def chat_token_ids(self, messages: list[dict], tools: list | None = None, **template_kwargs: Any) -> list[int]:
        text = await super().chat_token_ids(messages, tools, **template_kwargs)
        return list(range(len(text.split())))

def _out(channel: OutputChannel, ids: list[int], text: str, finish: str | None, n_prompt: int,
         n_out: int) -> RequestOutput:
    return RequestOutput(request_id=channel.request_id, token_ids=ids, text=text, finish_reason=finish,
                         num_prompt_tokens=n_prompt, num_output_tokens=n_out)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)

    def json(self) -> Any:
        return msgspec.json.decode(self.body)

    def events(self) -> list[Any]:
        """SSE `data:` payloads in order; "[DONE]" stays a string."""
        out = []
        for event in self.body.decode().split("\n\n"):
            if event:
                assert event.startswith("data: "), event
                data = event[len("data: "):]
                out.append(data if data == "[DONE]" else msgspec.json.decode(data))
        return out


async def call(app: Any, method: str, path: str, body: Any = b"", headers: dict[str, str] | None = None,
               disconnect_after_chunks: int | None = None, disconnect_after_s: float | None = None) -> Response:
    """One HTTP exchange with an ASGI app, optionally disconnecting mid-response."""
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    scope = {"type": "http", "method": method, "path": path, "headers":
             [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
             + [(b"content-length", str(len(raw)).encode())]}
    sent_body = False
    gone = asyncio.Event()
    response = Response(0, {})

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if disconnect_after_s is not None:
            try:
                await asyncio.wait_for(gone.wait(), disconnect_after_s)
            except TimeoutError:
                gone.set()  # the client leaves
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            response.status = message["status"]
            response.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            response.chunks.append(message.get("body", b""))
            response.body += message.get("body", b"")
            if disconnect_after_chunks is not None and len(response.chunks) >= disconnect_after_chunks:
                gone.set()
            if not message.get("more_body", False):
                gone.set()  # response complete: receive() reports the end, as uvicorn does

    await app(scope, receive, send)
    return response
