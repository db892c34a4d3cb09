"""Ollama's API, for Open WebUI, Continue, the `ollama` clients and the tools built on them:

    GET  /  HEAD /          "Ollama is running"           GET  /api/version     {"version"}
    GET  /api/tags          the served model               GET  /api/ps          it, resident
    POST /api/show          its details and capabilities
    POST /api/chat          chat (tools, format, options, think), NDJSON-streamed unless "stream": false
    POST /api/generate      a prompt through the chat template, or "raw": true as it is; an empty prompt only loads
                            the model (with keep_alive 0: unloads it), as Ollama does
    POST /api/embed         {input: str | [str], truncate, dimensions} -> {model, embeddings, durations, count}
    POST /api/embeddings    the legacy form: {prompt} -> {embedding} (not normalised, as Ollama's)
                            (both under `metrale serve --task embed`; chat and generate under --task generate)
    POST /api/pull /api/push /api/create /api/copy /api/delete
                            refused with Ollama's error body: the models served are the ones the server was started with

Requests are translated (ollama_protocol.py) into the OpenAI routes' requests and go through the same
validation, template, tool plan and engine stream (completions.open_stream). A streamed answer is one JSON object
per line; the last has "done": true, "done_reason" ("stop" | "length") and the counts and durations in
nanoseconds. Tool calls arrive whole, in the last object; reasoning the chat template shows is `message.thinking`
(`thinking` on /api/generate). Errors are `{"error": "<message>"}`.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

import msgspec

from metrale.errors import RequestFailedError
from metrale.outputs import RequestOutput
from metrale.server import chat_output, completions, embeddings, protocol
from metrale.server import ollama_protocol as op
from metrale.server.asgi import Receive, Send, run_until_disconnect, send_bytes, send_json
from metrale.server.access import MethodNotAllowed
from metrale.manager.keep_alive import parse_keep_alive
from metrale.server.errors import APIError, bad_request
from metrale.server.resolve import ModelListing, ModelResolver, Target

# The Ollama API version this surface follows; clients compare it to decide which fields to send.
API_VERSION = "0.12.0"
_NDJSON = [(b"content-type", b"application/x-ndjson")]
_REFUSED = {"/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete",
            "/api/blobs"}
_encode = msgspec.json.Encoder().encode


def serves(path: str) -> bool:
    return path == "/" or path.startswith("/api/")


async def handle(models: ModelResolver, method: str, path: str, body: bytes, send: Send,
                 receive: Receive, *, request_id: str | None = None, tool_call_format: str | None = None,
                 reasoning_parser: str | None = None, task: str = "generate") -> None:
    """Serve one Ollama API request; anything refused is `{"error": ...}` with the OpenAI routes' status.
    `task`: what the server runs ("generate" or "embed"); the other task's routes are a 400 naming it."""
    try:
        if path == "/":
            if method not in ("GET", "HEAD"):
                raise MethodNotAllowed(path, method, "GET, HEAD")
            return await send_bytes(send, 200, b"Ollama is running", [(b"content-type", b"text/plain")])
        if not models.ready():
            raise APIError(503, "model is loading; retry shortly", code="loading")
        if path in _READS:
            if method != "GET":
                raise MethodNotAllowed(path, method, "GET")
            return await send_json(send, 200, _READS[path](models))
        if method != "POST":
            raise MethodNotAllowed(path, method, "POST")
        if path == "/api/show":
            request = protocol.decode(body, op.ModelRequest)
            target = await models.resolve(op.model_name(request.model_name))
            return await send_json(send, 200, _show(target, task))
        if path in embeddings.OLLAMA_PATHS or path in ("/api/chat", "/api/generate"):
            _check_task(path, task)
        if path in embeddings.OLLAMA_PATHS:
            return await _embed(models, path, body, send, receive, request_id)
        if path not in ("/api/chat", "/api/generate"):
            raise APIError(400 if path in _REFUSED else 404, _refusal(path), code="not_supported")
        chat = path == "/api/chat"
        ollama_request = protocol.decode(body, op.ChatRequest if chat else op.GenerateRequest)
        if not chat and not ollama_request.prompt and not ollama_request.system:
            return await _load_or_unload(models, ollama_request, send)
        request = op.chat_request(ollama_request) if chat else op.generate_request(ollama_request)
        completions.check_before_loading(models, request, None)
        target = await models.resolve(request.model, keep_alive=keep_alive(ollama_request.keep_alive))
        call, stream = await completions.open_stream(target, request, default_max_tokens=None,
                                                     request_id=request_id, tool_call_format=tool_call_format,
                                                     reasoning_parser=reasoning_parser or "auto")
    except APIError as error:
        if error.reject_reason is not None:
            models.record_rejected(error.reject_reason)
        return await send_json(send, error.status, {"error": error.message}, error.headers)
    answer = _Answer(ollama_request.model, call, chat)
    respond = _stream_response if ollama_request.stream else _full_response
    try:
        await run_until_disconnect(respond(answer, stream, send), receive)
    finally:
        await stream.aclose()  # no-op once finished; aborts the request on disconnect or error


def _check_task(path: str, task: str) -> None:
    embedding = path in embeddings.OLLAMA_PATHS
    if embedding != (task == "embed"):
        raise APIError(400, f"this server runs task {task}; {path} needs a server started with --task "
                            f"{'embed' if embedding else 'generate'}", code="wrong_task",
                       reject_reason="invalid_request")


async def _embed(models: ModelResolver, path: str, body: bytes, send: Send, receive: Receive,
                 request_id: str | None) -> None:
    """/api/embed (normalised vectors) and the legacy /api/embeddings ({prompt} -> {embedding}, not normalised)."""
    started = time.monotonic_ns()
    legacy = path == "/api/embeddings"
    request = protocol.decode(body, op.EmbeddingsRequest if legacy else op.EmbedRequest)
    texts = [request.prompt] if legacy else [request.input] if isinstance(request.input, str) else request.input
    texts = [text for text in texts if text]  # Ollama answers an empty input with no embeddings
    inputs = embeddings.embedding_inputs(texts) if texts else []  # bounded before the model is resolved or loaded
    truncate = legacy or request.truncate  # Ollama keeps the start of a long input
    params = embeddings.pooling_params(normalize=not legacy, dimensions=None if legacy else request.dimensions,
                                       truncate_prompt_tokens=-1 if truncate else None, truncation_side="right")
    target = await models.resolve(op.model_name(request.model), keep_alive=keep_alive(request.keep_alive))
    embeddings.refuse_adapter(target.adapter)
    results = []
    if inputs:  # tokenized on the engine's tokenize thread when long, as /v1/embeddings' inputs
        results = await embeddings.run_embeddings(target.engine, inputs, params, receive, request_id,
                                                  renames={"prompt": "input", "truncate_prompt_tokens": "truncate"})
        if results is None:
            return
    if legacy:
        return await embeddings.send_json_off_loop(send, lambda: {"embedding": results[0].embedding if results else []})
    await embeddings.send_json_off_loop(send, lambda: {
        "model": request.model, "embeddings": [r.embedding for r in results],
        "total_duration": time.monotonic_ns() - started, "load_duration": 0,
        "prompt_eval_count": sum(r.num_prompt_tokens for r in results)})


async def _load_or_unload(models: ModelResolver, request: op.GenerateRequest, send: Send) -> None:
    """Ollama's /api/generate with an empty prompt: load the model and answer done_reason "load"; with keep_alive
    0, unload it ("unload": once this request ends; a model that is not resident is not loaded first)."""
    seconds = keep_alive(request.keep_alive)
    name = op.model_name(request.model)
    unload = seconds == 0 and models.loads_on_demand
    resident = any(name in (m.model_id, *m.aliases) and m.status == "loaded" for m in models.listing())
    known = any(name in (m.model_id, *m.aliases) for m in models.listing())
    if not (unload and known and not resident):
        await models.resolve(name, keep_alive=seconds)
    await send_json(send, 200, {"model": request.model, "created_at": _now(), "response": "", "done": True,
                                "done_reason": "unload" if unload else "load"})


def keep_alive(value: float | str | None) -> float | None:
    """A request's keep_alive in seconds (math.inf: forever; None: the server's default); 400 when malformed."""
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as error:
        raise bad_request(str(error), "keep_alive") from None


def _refusal(path: str) -> str:
    if path in _REFUSED:
        return f"{path} is not supported: this server serves the models it was started with"
    return f"no route for {path}"


class _Answer:
    """One answer's text, tool calls and timings as the deltas arrive."""

    def __init__(self, model: str, call: Any, chat: bool) -> None:
        self.model = model
        self.call = call
        self.chat = chat
        self.parser = call.plan.stream(call.prompt_tail) if call.plan is not None else None
        self.thinking: list[str] = []
        self.started_ns = time.monotonic_ns()
        self.first_token_ns: int | None = None
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}  # index -> name, arguments text
        self.last: RequestOutput | None = None

    def feed(self, out: RequestOutput) -> tuple[str, str]:
        """The (thinking, content) text this delta makes certain (tool calls are kept until the end)."""
        self.last = out
        if self.first_token_ns is None and out.token_ids:
            self.first_token_ns = time.monotonic_ns()
        if self.parser is None:
            self.text.append(out.text)
            return "", out.text
        fields = self.parser.delta(out.text, final=out.finish_reason is not None)
        for call in fields.get("tool_calls", ()):
            entry = self.calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] = call["function"].get("name") or entry["name"]
            entry["arguments"] += call["function"].get("arguments") or ""
        content, thinking = fields.get("content", ""), fields.get("reasoning_content", "")
        self.text.append(content)
        self.thinking.append(thinking)
        return thinking, content

    def chunk(self, content: str, tool_calls: bool = False, thinking: str = "") -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = [{"function": {"index": index, "name": call["name"],
                                                       "arguments": chat_output.arguments_object(call["arguments"])}}
                                         for index, call in sorted(self.calls.items())]
            body["message"] = message
        else:
            body["response"] = content
            if thinking:
                body["thinking"] = thinking
        return {**body, "done": False}

    def final(self, content: str, thinking: str = "") -> dict[str, Any]:
        """The last object: done, why, and Ollama's counts and durations (nanoseconds)."""
        last = self.last
        now = time.monotonic_ns()
        first = self.first_token_ns or now
        body = {**self.chunk(content, tool_calls=bool(self.calls), thinking=thinking), "done": True,
                "done_reason": "length" if last.finish_reason == "length" else "stop",
                "total_duration": now - self.started_ns, "load_duration": 0,
                "prompt_eval_count": last.num_prompt_tokens, "prompt_eval_duration": first - self.started_ns,
                "eval_count": last.num_output_tokens, "eval_duration": now - first}
        if not self.chat:
            body["context"] = []  # no resumable context: send the conversation again
        return body


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


async def _full_response(answer: _Answer, stream: Any, send: Send) -> None:
    await completions.read_whole(stream, answer.feed)
    await send_json(send, 200, answer.final("".join(answer.text), "".join(answer.thinking)))


async def _stream_response(answer: _Answer, stream: Any, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": _NDJSON})

    async def line(body: dict[str, Any], more: bool = True) -> None:
        await send({"type": "http.response.body", "body": _encode(body) + b"\n", "more_body": more})

    try:
        async for out in stream:
            if out.finish_reason in ("abort", "error"):
                answer.last = out
                continue  # abort: reported below; error: the stream raises next
            thinking, content = answer.feed(out)
            if content or thinking:
                await line(answer.chunk(content, thinking=thinking))
            if out.finish_reason is not None:
                return await line(answer.final(""), more=False)
    except RequestFailedError as error:
        return await line({"error": str(error)}, more=False)
    await line({"error": completions.ABORTED}, more=False)


def _model_entry(model: ModelListing) -> dict[str, Any]:
    """Ollama's model object; the family is known once the model has loaded."""
    info = model.engine.info() if model.engine is not None else None
    family = info.model_type if info is not None else ""
    path = info.model_path if info is not None else model.path
    return {"name": model.model_id, "model": model.model_id, "modified_at": _now(), "size": model.size_bytes,
            "digest": "",
            "details": {"parent_model": "", "format": "gguf" if path.endswith(".gguf") else "safetensors",
                        "family": family, "families": [family] if family else [], "parameter_size": "",
                        "quantization_level": ""}}


def _tags(models: ModelResolver) -> dict[str, Any]:
    return {"models": [_model_entry(model) for model in models.listing()]}


def _ps(models: ModelResolver) -> dict[str, Any]:
    return {"models": [{**_model_entry(model), "expires_at": _expiry(model.expires_at), "size_vram": 0,
                        "size": model.resident_bytes or model.size_bytes,
                        "context_length": model.engine.max_model_len}
                       for model in models.listing() if model.engine is not None and model.status == "loaded"]}


def _expiry(expires_at: float | None) -> str:
    if expires_at is None:
        return "9999-12-31T23:59:59Z"
    return datetime.fromtimestamp(expires_at, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _version(models: ModelResolver) -> dict[str, Any]:
    return {"version": API_VERSION}


def _show(target: Target, task: str) -> dict[str, Any]:
    engine = target.engine
    entry = _model_entry(ModelListing(target.model_id, engine=engine))
    if task == "embed":
        capabilities = ["embedding"]
    else:
        capabilities = ["completion"] + (["tools"] if engine.tool_call_format is not None else [])
    return {"modelfile": "", "parameters": "", "template": "", "license": "", "modified_at": entry["modified_at"],
            "details": entry["details"], "capabilities": capabilities,
            "model_info": {"general.architecture": entry["details"]["family"],
                           f"{entry['details']['family']}.context_length": engine.max_model_len}}


_READS = {"/api/tags": _tags, "/api/ps": _ps, "/api/version": _version}
