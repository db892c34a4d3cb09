"""OpenAI request bodies (msgspec Structs) and their translation into engine arguments.

Unknown fields are ignored, as OpenAI clients send many, but counted and warned about once per name
(metrale.server.unknown_fields); fields metrale does not implement are refused with a 400 naming them,
never silently dropped. Non-OpenAI sampling knobs (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, and vLLM's
allowed_token_ids, bad_words, structured_outputs, guided_*) are read from the top level, where the
openai client's `extra_body` puts them. Token masks and structured outputs are mapped in
metrale.server.structured, tools in metrale.server.tools.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from metrale.sampling_params import SamplingParams
from metrale.server import refusals, structured
from metrale.server.asgi import MAX_REQUEST_ID_CHARS, REQUEST_ID_PATTERN
from metrale.server.errors import bad_request, from_decode_error, request_field

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
MAX_MESSAGES = 4096  # turns of one chat request (the body's size bounds them too)
MAX_TOOLS = 256  # tools of one request
Messages = Annotated[list["ChatMessage"], msgspec.Meta(max_length=MAX_MESSAGES)]
Tools = Annotated[list[Any], msgspec.Meta(max_length=MAX_TOOLS)]
# The body's request_id, bounded like X-Request-Id (it names log lines and the response id)
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern=REQUEST_ID_PATTERN,
                                        description="printable ASCII without spaces, like X-Request-Id")]
MAX_N = 128  # choices per request, OpenAI's own limit: n sizes per-sequence work before any other check
ChoiceCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far on every chunk (guidellm sends it)


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: Any = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class _Refusable(msgspec.Struct, kw_only=True):
    """OpenAI / vLLM fields of both endpoints that metrale refuses when they ask for something
    (metrale.server.refusals); declared so that none is silently dropped."""

    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    priority: Any = None
    prompt_embeds: Any = None
    add_special_tokens: Any = None
    watermarking: Any = None
    truncation_side: Any = None
    logprob_token_ids: Any = None
    return_weight_versions: Any = None
    routed_experts_prompt_start: Any = None
    return_token_offsets: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    ec_transfer_params: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    stream_interval: Any = None


class _SamplingFields(_Refusable, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: ChoiceCount = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None  # accepted: an end-user id for the caller's records, it changes nothing here
    session_id: str | None = None  # vLLM's: accepted like user, a conversation's id; the prefix cache is automatic
    prompt_logprobs: Int64 | None = None
    request_id: RequestId | None = None  # vLLM's: names the engine request (and the response id) like X-Request-Id
    best_of: ChoiceCount | None = None  # honoured when it equals n; more is refused


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: str | list[Any]
    max_tokens: Int64 | None = 16
    echo: bool = False
    suffix: str | None = None
    logprobs: Int64 | None = None


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, given back (Qwen3's template reads it)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Messages
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: Tools | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    safety_identifier: str | None = None  # accepted like user: an id for the caller's records
    prompt_cache_key: str | None = None  # accepted: the prefix cache is automatic, the key changes nothing here
    # refused when they ask for something (metrale.server.refusals.CHAT)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    metadata: Any = None
    store: Any = None
    reasoning_effort: str | None = None  # given to the chat template (gpt-oss reads it); "none" turns thinking off
    include_reasoning: bool | None = None  # vLLM's: false drops reasoning_content from the response
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    echo: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    documents: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    media_io_kwargs: Any = None
    return_prompt_text: Any = None


_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
                "include_stop_str_in_output", "skip_special_tokens")
# The engine's parameter names (an error's `field`) that these endpoints call otherwise.
COMPLETION_FIELDS = {"bad_words_token_ids": "bad_words"}
CHAT_FIELDS = {**COMPLETION_FIELDS, "prompt": "messages"}
_TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt")  # set by the server itself
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Parse a JSON body into `kind`; a 400 with the offending field on any error."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as error:  # ValidationError is a DecodeError
        raise from_decode_error(error) from error
    except RecursionError as error:  # e.g. {"prompt": [[[[...]]]]} nested 100k deep
        raise bad_request("invalid request body: JSON nested too deeply") from error


MAX_PROMPTS = 64  # prompts in one /v1/completions request (OpenAI's batch form); bounded before any work


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: one string or token-id list, or a list of them (OpenAI's batch
    form, which LangChain's `OpenAI().batch()` sends), at most MAX_PROMPTS, none empty."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and all(type(t) is int for t in prompt)):
        prompts: list[Any] = [prompt]
    else:
        prompts = prompt
        if len(prompts) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
        for item in prompts:
            if not isinstance(item, (str, list)) or (isinstance(item, list) and
                                                     not all(type(t) is int for t in item)):
                raise bad_request("prompt must be a string, a list of token ids, or a list of either", "prompt")
    if not prompts or not all(prompts):
        raise bad_request("prompt is empty", "prompt")
    return prompts


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as plain dicts for `engine.chat`, which checks roles and content parts."""
    if not request.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    return msgspec.to_builtins(request.messages)


def sampling_params(request: CompletionRequest | ChatCompletionRequest,
                    default_max_tokens: int | None, model_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """Validate and translate the sampling fields; a 400 naming the field on any bad value.

    A chat request that sets neither max_tokens nor max_completion_tokens gets `default_max_tokens`,
    and when that is None too, the rest of the context (the engine's max_model_len minus the prompt,
    vLLM's rule). Completions default to OpenAI's 16; `"max_tokens": null` is treated like a chat request's.
    `model_defaults` (the engine's sampling_defaults: the model's generation_config.json) fill the sampling
    fields the request leaves unset.
    """
    _refuse_unsupported(request)
    kwargs: dict[str, Any] = {}
    for name in _PASSTHROUGH:
        value = getattr(request, name)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value}", name)
        kwargs[name] = value
    for name, value in (model_defaults or {}).items():
        kwargs.setdefault(name, value)
    if request.stop is not None:
        kwargs["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        kwargs["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens  # None: the rest
    else:  # OpenAI's default is 16 (the field's default); an explicit null asks for the rest, as in vLLM
        kwargs["max_tokens"] = request.max_tokens if request.max_tokens is not None else default_max_tokens
    logprobs = _logprobs(request)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    kwargs["n"] = request.n
    prompt_logprobs = request.prompt_logprobs
    if isinstance(request, CompletionRequest) and request.echo and logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)  # echo returns the prompt's logprobs too
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    kwargs.update(structured.sampling_fields(request))
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as error:
        raise bad_request(str(error), request_field(error)) from error


def _logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        if not request.logprobs:
            if request.top_logprobs:
                raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
            return None
        return request.top_logprobs or 0
    return request.logprobs


def _refuse_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    refusals.refuse(request, chat=isinstance(request, ChatCompletionRequest))
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request(f"best_of must equal n ({request.n}): every sampled sequence is returned, choosing "
                          f"the best {request.n} of {request.best_of} is not supported", "best_of")


def template_kwargs(request: Any) -> dict[str, Any]:
    """chat_template_kwargs as keyword arguments of the chat template (e.g. enable_thinking=False), and
    reasoning_effort as the template variable of that name (gpt-oss's); reasoning_effort "none" also sets
    enable_thinking=False (Qwen3's switch) unless the kwargs set it."""
    kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
    for name in kwargs:
        if not name.isidentifier() or name in _TEMPLATE_RESERVED:
            raise bad_request(f"chat_template_kwargs cannot set {name!r}", "chat_template_kwargs")
    effort = request.reasoning_effort
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}",
                              "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
        if effort == "none":
            kwargs.setdefault("enable_thinking", False)
    return kwargs


