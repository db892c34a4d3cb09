"""POST /tokenize and /detokenize, in vLLM's shapes (tools that count tokens or check a prompt without a local
tokenizer call them):

    /tokenize    {"prompt": "..."} or {"messages": [...], "tools", "chat_template_kwargs", "add_generation_prompt"}
                 -> {"count", "max_model_len", "tokens": [...], "token_strs": [...] | null}
    /detokenize  {"tokens": [...]} -> {"prompt": "..."}

The prompt goes through what /v1/completions and /v1/chat/completions would submit (the same tokenizer, the
same chat template and tools), so `count` is the prompt_tokens a request would use. Token ids are checked like a
prompt's (ids outside the vocabulary are a 400); at most max_model_len of them are decoded.
"""

from __future__ import annotations

from typing import Any

import msgspec

from metrale.engine.protocol import EngineClient
from metrale.server import completions, protocol
from metrale.server.asgi import Send, send_json
from metrale.server.errors import bad_request, from_decode_error
from metrale.server.resolve import ModelResolver

PATHS = ("/tokenize", "/detokenize")


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[protocol.ChatMessage] | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[protocol.Int64]
    model: str | None = None


async def handle(models: ModelResolver, path: str, body: bytes, send: Send) -> None:
    if path == "/detokenize":
        request = protocol.decode(body, DetokenizeRequest)
        engine = (await models.resolve(request.model)).engine
        if len(request.tokens) > engine.max_model_len:
            raise bad_request(f"tokens holds {len(request.tokens)} ids; at most max_model_len "
                              f"({engine.max_model_len}) are decoded", "tokens")
        with completions.engine_errors({"prompt": "tokens"}):
            token_ids = await engine.prompt_token_ids(request.tokens)  # checks every id against the vocabulary
        return await send_json(send, 200, {"prompt": engine.decode(token_ids)})
    request = protocol.decode(body, TokenizeRequest)
    _check(request)  # before the model is resolved (or loaded)
    engine = (await models.resolve(request.model)).engine
    token_ids = await _token_ids(engine, request)
    await send_json(send, 200, {"count": len(token_ids), "max_model_len": engine.max_model_len, "tokens": token_ids,
                                "token_strs": engine.token_texts(token_ids) if request.return_token_strs else None})


def _check(request: TokenizeRequest) -> None:
    """A 400 for what no model could tokenize: both or neither of prompt and messages, unsupported flags."""
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if request.prompt is not None and not request.add_special_tokens:
        raise bad_request("add_special_tokens: false is not supported; the prompt is encoded as "
                          "/v1/completions encodes it", "add_special_tokens")
    if request.messages is not None and not request.add_generation_prompt:
        raise bad_request("add_generation_prompt: false is not supported; the messages are rendered as "
                          "/v1/chat/completions renders them", "add_generation_prompt")


async def _token_ids(engine: EngineClient, request: TokenizeRequest) -> list[int]:
    if request.prompt is not None:
        with completions.engine_errors():
            return list(await engine.prompt_token_ids(request.prompt))
    try:  # the chat request's own constraints (e.g. at least one message): a 400, as on /v1/chat/completions
        chat = msgspec.convert({"messages": msgspec.to_builtins(request.messages), "tools": request.tools,
                                "chat_template_kwargs": request.chat_template_kwargs}, protocol.ChatCompletionRequest)
    except msgspec.ValidationError as error:
        raise from_decode_error(error) from error
    return list(await completions.prompt_token_ids(engine, chat))
