"""POST /v1/embeddings, in OpenAI's shape (with vLLM's extra fields), and the run shared with Ollama's embed routes:

    {"model", "input": str | [str] | [int] | [[int]], "encoding_format": "float" | "base64", "dimensions",
     "user", "truncate_prompt_tokens" (vLLM), "normalize" (vLLM)}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
        "usage": {"prompt_tokens", "total_tokens"}}

`input` is bounded (MAX_EMBED_INPUTS, each input by max_model_len) before any work; an empty string, an empty
list, bad token ids, a too-long input without truncate_prompt_tokens, or `dimensions` on a model that is not
Matryoshka-trained is a 400 and queues nothing. base64 is the float32 little-endian bytes, as the openai SDK
decodes them (and sends by default). A client that disconnects aborts every input still running.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import msgspec

from metrale.engine.protocol import EngineClient
from metrale.errors import RequestFailedError
from metrale.outputs import EmbeddingOutput
from metrale.pooling_params import MAX_EMBED_INPUTS, PoolingParams
from metrale.server import completions, protocol
from metrale.server.asgi import Receive, Send, run_until_disconnect, send_bytes
from metrale.server.errors import APIError, bad_request
from metrale.server.resolve import ModelResolver
from metrale.server.unknown_fields import UnknownFields

PATH = "/v1/embeddings"
OLLAMA_PATHS = ("/api/embed", "/api/embeddings")
EMBEDDING_PATHS = (PATH, *OLLAMA_PATHS)
_FIELDS = {"prompt": "input"}  # the engine's parameter names as this route calls them
_encode = msgspec.json.Encoder().encode
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# what `embedding_inputs` accepts, as JSON Schema (msgspec cannot type a union of several list types)
Inputs = Annotated[Any, msgspec.Meta(extra_json_schema={"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_EMBED_INPUTS},
    _TOKEN_IDS,
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_EMBED_INPUTS}]})]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: Inputs  # str | list[str] | list[int] | list[list[int]]: checked by `embedding_inputs`
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: protocol.Int64 | None = None
    user: str | None = None  # accepted; it changes nothing here
    truncate_prompt_tokens: protocol.Int64 | None = None  # vLLM's: keep the last k tokens (-1: max_model_len)
    normalize: bool = True  # vLLM's


def embedding_inputs(value: Any, field: str = "input") -> list[str | list[int]]:
    """The inputs of `value` (one string or token-id list, or a list of them), at most MAX_EMBED_INPUTS, none
    empty; a 400 naming `field` otherwise."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_token_id(t) for t in value)):
        inputs: list[Any] = [value]
    elif isinstance(value, list) and value:
        inputs = value
    else:
        raise bad_request(f"{field} must be a non-empty string, list of strings, list of token ids or list of "
                          f"lists of token ids", field)
    if len(inputs) > MAX_EMBED_INPUTS:
        raise bad_request(f"at most {MAX_EMBED_INPUTS} inputs per request, got {len(inputs)}", field)
    for index, item in enumerate(inputs):
        if isinstance(item, str) and item:
            continue
        if isinstance(item, list) and item and all(_is_token_id(t) for t in item):
            continue
        raise bad_request(f"{field}[{index}] must be a non-empty string or a non-empty list of token ids", field)
    return inputs


def refuse_adapter(adapter: str | None, field: str = "model") -> None:
    """A 400 when the request's model names a LoRA adapter: embeddings run the base model only."""
    if adapter is not None:
        raise bad_request(f"{adapter!r} is a LoRA adapter; embeddings run the base model only", field)


def pooling_params(**fields: Any) -> PoolingParams:
    """PoolingParams(**fields); a 400 naming the bad field (e.g. dimensions 0) instead of a ValueError."""
    try:
        return PoolingParams(**fields)
    except ValueError as error:
        raise bad_request(str(error), getattr(error, "field", None)) from error


def _is_token_id(value: Any) -> bool:
    return type(value) is int


async def run_embeddings(engine: EngineClient, inputs: Sequence[str | list[int]], params: PoolingParams,
                         receive: Receive, request_id: str | None,
                         renames: dict[str, str] | None = None) -> list[EmbeddingOutput] | None:
    """Embed `inputs` (engine errors as APIErrors); None when the client disconnected (every input aborted)."""
    results: list[EmbeddingOutput] = []

    async def embed() -> None:
        with completions.engine_errors(renames or _FIELDS):
            results.extend(await engine.embed(inputs, params, request_id=request_id))

    try:
        disconnected = await run_until_disconnect(embed(), receive)
    except RequestFailedError as error:
        raise APIError(500, str(error), code="request_failed") from error
    return None if disconnected else results


async def handle(models: ModelResolver, body: bytes, send: Send, receive: Receive, *, request_id: str | None = None,
                 unknown_fields: UnknownFields | None = None) -> None:
    request = protocol.decode(body, EmbeddingRequest)
    if unknown_fields is not None:
        unknown_fields.check(body, EmbeddingRequest, PATH)
    inputs = embedding_inputs(request.input)  # checked before the model is resolved (or loaded)
    params = pooling_params(normalize=request.normalize, dimensions=request.dimensions,
                            truncate_prompt_tokens=request.truncate_prompt_tokens)
    target = await models.resolve(request.model)
    refuse_adapter(target.adapter)
    engine, model = target.engine, target.model_id
    results = await run_embeddings(engine, inputs, params, receive, request_id)
    if results is None:
        return
    encode: Callable[[EmbeddingOutput], Any] = _base64 if request.encoding_format == "base64" else _floats
    num_tokens = sum(r.num_prompt_tokens for r in results)
    await send_json_off_loop(send, lambda: {
        "object": "list", "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": encode(r)} for i, r in enumerate(results)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def send_json_off_loop(send: Send, build: Callable[[], Any]) -> None:
    """A 200 JSON response whose body (up to MAX_EMBED_INPUTS vectors of floats) is built and encoded on a worker
    thread, so that the event loop never stalls on it."""
    body = await asyncio.to_thread(lambda: _encode(build()))
    await send_bytes(send, 200, body, [(b"content-type", b"application/json")])


def _base64(result: EmbeddingOutput) -> str:
    return base64.b64encode(result.data).decode("ascii")


def _floats(result: EmbeddingOutput) -> list[float]:
    return result.embedding
