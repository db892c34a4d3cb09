"""Ollama API request bodies (msgspec Structs) and their translation into OpenAI-shaped chat / completion requests.

    /api/chat      messages (tool_calls with argument objects, tool turns with tool_name) -> ChatCompletionRequest
    /api/generate  prompt (+ system), rendered through the chat template   -> ChatCompletionRequest
                   raw: true, the prompt as it is                           -> CompletionRequest
    options        temperature top_p top_k min_p seed stop num_predict repeat_penalty presence_penalty
                   frequency_penalty -> the sampling fields; the load-time and resource knobs Ollama's runner
                   takes (num_ctx, num_batch, num_gpu, num_thread, use_mmap, ...) change nothing here;
                   sampling methods metrale does not have (mirostat, typical_p < 1, tfs_z) are refused
    format         "json" -> a JSON object; a JSON schema -> that schema (both grammar-enforced)
    think          true / false / "low" | "medium" | "high" -> chat_template_kwargs enable_thinking, reasoning_effort
    keep_alive     how long the model stays resident once idle ("5m", seconds, 0: unload now, negative: forever);
                   with one model (--model PATH) it stays for the server's life
    /api/embed     input (a string or a list), truncate, dimensions -> metrale.server.embeddings' run
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec

from metrale.server import protocol
from metrale.server.errors import bad_request

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
UNLIMITED = (-1, -2)  # num_predict: -1 until the context is full, -2 fill the context: both are "the rest"


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # sampling
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: list[str] | None = None
    num_predict: Int64 | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # refused unless they ask for nothing
    mirostat: Int64 | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    # accepted, changing nothing here: the runner's resources and context are the server's settings
    repeat_last_n: Int64 | None = None  # the repetition penalty looks at the whole output
    penalize_newline: bool | None = None
    num_keep: Int64 | None = None
    num_ctx: Int64 | None = None
    num_batch: Int64 | None = None
    num_gpu: Int64 | None = None
    main_gpu: Int64 | None = None
    num_thread: Int64 | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None


class Function(msgspec.Struct, kw_only=True):
    name: str
    arguments: Any = None
    index: Int64 | None = None


class ToolCall(msgspec.Struct, kw_only=True):
    function: Function


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str
    stream: bool = True  # Ollama streams unless told not to
    format: Any = None
    options: Options | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None


class ChatRequest(_Common, kw_only=True):
    """POST /api/chat."""

    messages: Annotated[list[Message], msgspec.Meta(max_length=protocol.MAX_MESSAGES)] = []
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=protocol.MAX_TOOLS)] | None = None


class GenerateRequest(_Common, kw_only=True):
    """POST /api/generate."""

    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[Int64] | None = None
    raw: bool = False
    images: list[Any] | None = None


class EmbedRequest(msgspec.Struct, kw_only=True):
    """POST /api/embed: `truncate` (default true) cuts each input to the context, keeping its start."""

    model: str
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: Int64 | None = None
    options: Options | None = None  # accepted: none of its knobs changes an embedding here
    keep_alive: float | str | None = None


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """POST /api/embeddings (the legacy route): one prompt, its vector not normalised (as Ollama's)."""

    model: str
    prompt: str = ""
    options: Options | None = None
    keep_alive: float | str | None = None


class ModelRequest(msgspec.Struct, kw_only=True):
    """POST /api/show (Ollama's older clients send `name`)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None

    @property
    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise bad_request("model is required", "model")
        return name


def model_name(name: str) -> str:
    """Ollama's `name:tag` with the default tag dropped: "smollm2:latest" asks for "smollm2"."""
    return name.removesuffix(":latest")


def chat_request(request: ChatRequest) -> protocol.ChatCompletionRequest:
    body = _common(request)
    body["messages"] = _messages(request.messages)
    if request.tools:
        body["tools"] = request.tools
    return msgspec.convert(body, protocol.ChatCompletionRequest)


def generate_request(request: GenerateRequest) -> protocol.ChatCompletionRequest | protocol.CompletionRequest:
    for name in ("template", "suffix", "context", "images"):
        if getattr(request, name):
            raise bad_request(f"{name} is not supported by this server", name)
    body = _common(request)
    if request.raw:
        body.pop("chat_template_kwargs", None)
        return msgspec.convert({"max_tokens": None, **body, "prompt": request.prompt}, protocol.CompletionRequest)
    messages = [{"role": "system", "content": request.system}] if request.system else []
    body["messages"] = [*messages, {"role": "user", "content": request.prompt}]
    return msgspec.convert(body, protocol.ChatCompletionRequest)


def _common(request: _Common) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model_name(request.model), "stream": request.stream}
    body.update(_sampling(request.options or Options()))
    if request.format not in (None, ""):
        body["response_format"] = _format(request.format)
    if request.think is not None:
        body["chat_template_kwargs"] = _think(request.think)
    if request.logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = request.top_logprobs or 0
    return body


def _sampling(options: Options) -> dict[str, Any]:
    if options.mirostat not in (None, 0):
        raise bad_request("options.mirostat is not supported (use temperature, top_k, top_p, min_p)", "options")
    if options.typical_p not in (None, 1.0) or options.tfs_z not in (None, 1.0):
        raise bad_request("options.typical_p and options.tfs_z are not supported", "options")
    fields = {name: getattr(options, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed",
                                                         "presence_penalty", "frequency_penalty")}
    fields["repetition_penalty"] = options.repeat_penalty
    fields["stop"] = options.stop or None
    if options.num_predict is not None and options.num_predict not in UNLIMITED:
        if options.num_predict < 0:
            raise bad_request("options.num_predict must be >= 0, -1 or -2", "options")
        fields["max_tokens"] = options.num_predict
    return {name: value for name, value in fields.items() if value is not None}


def _format(value: Any) -> dict[str, Any]:
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise bad_request('format must be "json" or a JSON schema object', "format")


def _think(value: bool | str) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"enable_thinking": value}
    if value not in ("low", "medium", "high"):
        raise bad_request('think must be true, false, "low", "medium" or "high"', "think")
    return {"enable_thinking": True, "reasoning_effort": value}


def _messages(messages: list[Message]) -> list[dict[str, Any]]:
    if not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for index, message in enumerate(messages):
        if message.images:
            raise bad_request(f"messages[{index}].images: images are not supported (text-only models)", "messages")
        turn: dict[str, Any] = {"role": message.role, "content": message.content or ""}
        if message.tool_calls:
            turn["tool_calls"] = [{"id": f"call_{index}_{j}", "type": "function",
                                   "function": {"name": call.function.name,
                                                "arguments": json.dumps(call.function.arguments or {})}}
                                  for j, call in enumerate(message.tool_calls)]
        if message.role == "tool" and message.tool_name:
            turn["name"] = message.tool_name
        out.append(turn)
    return out
