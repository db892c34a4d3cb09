"""Request fields metrale does not implement, refused with a 400 naming them; nothing is silently dropped.

A field is refused only when its value asks for something: `null` and the value that means "off" (a
vLLM default such as use_beam_search: false, or store: false) pass. Every field of OpenAI's and vLLM's
completion and chat request schemas is either honoured by the server or listed here
(tests/server/test_request_fields.py walks them all; scripts/vllm_request_fields.py VLLM_SOURCE prints the fields
of a newer vLLM that metrale's structs do not declare yet). Fields nobody declares are counted and warned about
(metrale.server.unknown_fields); ALIASES, other servers' names for metrale's fields, are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from metrale.server.errors import bad_request


@dataclass(frozen=True, slots=True)
class Refusal:
    field: str
    allowed: Callable[[Any], bool]  # values that ask for nothing missing (null always passes)
    reason: str


def _never(value: Any) -> bool:
    return False


def _off(value: Any) -> bool:
    return value is False


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is type(v) for v in values)


BOTH = (
    Refusal("use_beam_search", _off, "is not supported: metrale samples, it has no beam search"),
    Refusal("length_penalty", _is(1.0, 1), "only applies to beam search, which metrale does not have"),
    Refusal("spaces_between_special_tokens", _is(True), "false is not supported"),
    Refusal("truncate_prompt_tokens", _never, "is not supported: prompts are never truncated, a too long one "
                                             "is a 400"),
    Refusal("guided_decoding_backend", _is("auto", "guidance", "llguidance"), "must be llguidance (the only one)"),
    Refusal("guided_whitespace_pattern", _never, "is not supported"),
    Refusal("logits_processors", _never, "is not supported"),
    Refusal("return_tokens_as_token_ids", _off, "is not supported"),
    Refusal("return_token_ids", _off, "is not supported"),
    Refusal("cache_salt", _never, "is not supported"),
    Refusal("kv_transfer_params", _never, "is not supported: metrale has no KV transfer"),
    Refusal("vllm_xargs", _never, "is not supported"),
    Refusal("priority", _is(0), "is not supported: metrale serve schedules first come, first served"),
    Refusal("prompt_embeds", _never, "is not supported: prompts are text or token ids"),
    # vLLM 0.34's (scripts/vllm_request_fields.py lists what metrale's structs lack)
    Refusal("watermarking", _off, "is not supported"),
    Refusal("truncation_side", _never, "is not supported: prompts are never truncated, a too long one is a 400"),
    Refusal("logprob_token_ids", _never, "is not supported: use logprobs (the top alternatives)"),
    Refusal("return_weight_versions", _off, "is not supported"),
    Refusal("routed_experts_prompt_start", _is(0), "is not supported: no routed-expert data is returned"),
    Refusal("return_token_offsets", _off, "is not supported (vLLM honours it only on its render endpoints)"),
    Refusal("mm_payload", _never, "is not supported: text only"),
    Refusal("return_mm_kwargs", _is(True, False), "must be a boolean (it changes nothing here: text only)"),
    Refusal("ec_transfer_params", _never, "is not supported: metrale has no encoder-cache transfer"),
    Refusal("repetition_detection", _never, "is not supported"),
    Refusal("thinking_token_budget", _is(-1), "is not supported: thinking is not budgeted (-1, unlimited, passes)"),
    Refusal("stream_interval", _is(1), "is not supported: each delta is streamed as it comes (1 passes)"),
)
COMPLETIONS = (
    Refusal("suffix", _is(""), "is not supported"),
    Refusal("add_special_tokens", _is(True), "false is not supported on /v1/completions"),
)
CHAT = (
    Refusal("audio", _never, "is not supported: text only"),
    Refusal("modalities", _is(["text"]), "must be [\"text\"]: text only"),
    Refusal("prediction", _never, "is not supported (no predicted outputs)"),
    Refusal("functions", _never, "is deprecated and not supported; use tools"),
    Refusal("function_call", _never, "is deprecated and not supported; use tool_choice"),
    Refusal("metadata", _is({}), "is not supported: completions are not stored"),
    Refusal("store", _off, "is not supported: completions are not stored"),
    Refusal("verbosity", _never, "is not supported"),
    Refusal("web_search_options", _never, "is not supported: metrale has no web search"),
    Refusal("service_tier", _is("auto", "default"), "must be \"auto\" or \"default\""),
    Refusal("echo", _off, "is not supported on chat completions"),
    Refusal("add_generation_prompt", _is(True), "false is not supported"),
    Refusal("continue_final_message", _off, "is not supported"),
    Refusal("add_special_tokens", _off, "true is not supported on chat completions (the template adds them)"),
    Refusal("documents", _never, "is not supported"),
    Refusal("chat_template", _never, "is not supported: the model's own template is used"),
    Refusal("mm_processor_kwargs", _never, "is not supported: text only"),
    Refusal("moderation", _never, "is not supported"),
    Refusal("prompt_cache_options", _never, "is not supported: the prefix cache is automatic, LRU-evicted"),
    Refusal("prompt_cache_retention", _never, "is not supported: the prefix cache is automatic, LRU-evicted"),
    Refusal("media_io_kwargs", _never, "is not supported: text only"),
    Refusal("return_prompt_text", _off, "is not supported"),
)
# Other servers' names for a field metrale has: ignoring one would silently give another result than the client
# asked for (max_new_tokens: 40 gave OpenAI's default of 16 tokens), so each is a 400 pointing at the right name.
ALIASES = {
    "max_new_tokens": "max_tokens",  # Hugging Face generate / TGI
    "max_length": "max_tokens",  # Hugging Face generate (counts the prompt too)
    "max_output_tokens": "max_tokens",  # the Responses API's and Gemini's name
    "num_predict": "max_tokens",  # Ollama's option
    "stop_sequences": "stop",  # Anthropic's and TGI's name
    "num_return_sequences": "n",  # Hugging Face generate
}


def refuse_aliases(unknown: list[str]) -> None:
    """A 400 for the first unknown field that is another server's name for one of metrale's."""
    for name in unknown:
        if name in ALIASES:
            raise bad_request(f"{name} is not a field of this API (it would be ignored); did you mean "
                              f"{ALIASES[name]}?", name)


def refuse(request: Any, chat: bool) -> None:
    """A 400 naming the first field of `request` that asks for something metrale does not implement."""
    for refusal in (*BOTH, *(CHAT if chat else COMPLETIONS)):
        value = getattr(request, refusal.field)
        if value is not None and not refusal.allowed(value):
            raise bad_request(f"{refusal.field} {refusal.reason} (got {value!r})", refusal.field)
