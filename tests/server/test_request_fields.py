"""Every field of OpenAI's and vLLM's completion and chat request schemas is honoured (a behavioural test
is named for it) or accepted with a stated reason it changes nothing, or refused with a 400 naming it.
Nothing is silently ignored.

The lists are written from the API references: OpenAI's "Create completion" and "Create chat completion"
(platform.openai.com/docs/api-reference), cross-checked against the installed openai client's request
TypedDicts, and vLLM's extra parameters of its OpenAI-compatible server (docs.vllm.ai, "OpenAI-Compatible
Server", Extra Parameters; vllm/entrypoints/openai/protocol.py CompletionRequest / ChatCompletionRequest), and
vLLM 0.34's vllm/entrypoints/openai/{completion,chat_completion}/protocol.py as scripts/vllm_request_fields.py
reads them (it printed the 13 + 15 names added then: it should print none).
"""

from __future__ import annotations

import importlib

import msgspec
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from metrale.server.app import ServerApp
from metrale.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.fakes import FakeEngine, call

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
APP, SURFACE, STRUCT = "tests/server/test_app.py", "tests/server/test_surface.py", "tests/server/test_structured_app.py"
CLIENT, TOOLS = "tests/server/test_openai_client.py", "tests/server/test_tools_openai.py"
REASONING = "tests/server/test_reasoning.py"
PASSTHROUGH = f"{APP}::test_extra_sampling_fields_reach_sampling_params"


def honoured(test: str) -> tuple[str, str]:
    return ("honoured", test)


def accepted(reason: str) -> tuple[str, str]:
    return ("accepted", reason)


def refused(value) -> tuple[str, object]:
    return ("refused", value)


SHARED_OPENAI = {  # in both OpenAI schemas
    "model": honoured(f"{APP}::test_bad_requests_are_openai_errors"),  # another model is a 404 naming it
    "frequency_penalty": honoured(PASSTHROUGH),
    "presence_penalty": honoured(PASSTHROUGH),
    "logit_bias": honoured(f"{STRUCT}::test_token_mask_fields_reach_the_params"),
    "max_tokens": honoured(f"{APP}::test_completion_shape"),
    "seed": honoured(f"{SURFACE}::test_seeded_n_is_reproducible"),
    "stop": honoured(PASSTHROUGH),
    "stream": honoured(f"{APP}::test_completion_stream_shape"),
    "stream_options": honoured(f"{APP}::test_completion_stream_shape"),
    "temperature": honoured(PASSTHROUGH),
    "top_p": honoured(PASSTHROUGH),
    "user": accepted("an end-user id for the caller's records (abuse monitoring at OpenAI); no effect on output"),
}
COMPLETION_OPENAI = {
    **SHARED_OPENAI,
    "prompt": honoured(f"{APP}::test_completion_shape"),
    "echo": honoured(f"{SURFACE}::test_echo_returns_the_prompt_first"),
    "logprobs": honoured(f"{SURFACE}::test_echo_with_logprobs_scores_the_prompt_tokens"),
    "n": honoured(f"{SURFACE}::test_n_choices_are_indexed_and_usage_counts_the_prompt_once"),
    "best_of": refused(3),  # honoured when equal to n (every sampled sequence is returned)
    "suffix": refused("tail"),
}
CHAT_OPENAI = {
    **SHARED_OPENAI,
    "messages": honoured(f"{APP}::test_chat_shapes"),
    "logprobs": honoured(f"{CLIENT}::test_logprobs"),
    "top_logprobs": honoured(f"{CLIENT}::test_logprobs"),
    "max_completion_tokens": honoured(f"{APP}::test_chat_default_max_tokens_and_content_parts"),
    "n": honoured(f"{SURFACE}::test_n_chat_stream_sends_every_choice_with_its_index"),
    "response_format": honoured(f"{STRUCT}::test_constraint_fields_reach_the_params_and_are_prepared"),
    "tools": honoured(f"{STRUCT}::test_required_and_named_tool_choice_become_constraints"),
    "tool_choice": honoured(f"{STRUCT}::test_required_and_named_tool_choice_become_constraints"),
    "parallel_tool_calls": honoured(f"{TOOLS}::test_required_gives_valid_calls"),
    "prompt_cache_key": accepted("a routing hint for OpenAI's cache; metrale's prefix cache is automatic"),
    "safety_identifier": accepted("an end-user id for the caller's records; no effect on output"),
    "audio": refused({"voice": "alloy", "format": "wav"}),
    "modalities": refused(["text", "audio"]),
    "prediction": refused({"type": "content", "content": "x"}),
    "functions": refused([{"name": "f"}]),
    "function_call": refused("auto"),
    "metadata": refused({"k": "v"}),
    "store": refused(True),
    "reasoning_effort": honoured(f"{REASONING}::test_reasoning_effort_and_template_kwargs_reach_the_template"),
    "verbosity": refused("low"),
    "web_search_options": refused({}),
    "service_tier": refused("flex"),
    "moderation": refused({"model": "omni"}),
    "prompt_cache_options": refused({"mode": "explicit"}),
    "prompt_cache_retention": refused("24h"),
}
SHARED_VLLM = {  # vLLM's extra parameters of both endpoints
    "top_k": honoured(PASSTHROUGH),
    "min_p": honoured(PASSTHROUGH),
    "repetition_penalty": honoured(PASSTHROUGH),
    "stop_token_ids": honoured(PASSTHROUGH),
    "include_stop_str_in_output": honoured(PASSTHROUGH),
    "ignore_eos": honoured(PASSTHROUGH),
    "min_tokens": honoured(PASSTHROUGH),
    "skip_special_tokens": honoured(PASSTHROUGH),
    "allowed_token_ids": honoured(f"{STRUCT}::test_token_mask_fields_reach_the_params"),
    "bad_words": honoured(f"{STRUCT}::test_token_mask_fields_reach_the_params"),
    "prompt_logprobs": honoured(f"{SURFACE}::test_echo_with_logprobs_scores_the_prompt_tokens"),
    "response_format": honoured(f"{STRUCT}::test_constraint_fields_reach_the_params_and_are_prepared"),
    "structured_outputs": honoured(f"{STRUCT}::test_constraint_fields_reach_the_params_and_are_prepared"),
    "guided_json": honoured(f"{STRUCT}::test_constraint_fields_reach_the_params_and_are_prepared"),
    "guided_regex": honoured(f"{STRUCT}::test_constraint_fields_reach_the_params_and_are_prepared"),
    "guided_choice": honoured(f"{STRUCT}::test_constraint_fields_reach_the_params_and_are_prepared"),
    "guided_grammar": honoured(f"{STRUCT}::test_constraint_fields_reach_the_params_and_are_prepared"),
    "request_id": honoured(f"{APP}::test_request_id_names_the_request_and_the_response"),
    "best_of": refused(3),
    "use_beam_search": refused(True),
    "length_penalty": refused(2.0),
    "spaces_between_special_tokens": refused(False),
    "truncate_prompt_tokens": refused(8),
    "guided_decoding_backend": refused("xgrammar"),
    "guided_whitespace_pattern": refused(r"\s*"),
    "logits_processors": refused(["my.processor"]),
    "return_tokens_as_token_ids": refused(True),
    "return_token_ids": refused(True),
    "cache_salt": refused("salt"),
    "kv_transfer_params": refused({"do_remote_prefill": True}),
    "vllm_xargs": refused({"a": 1}),
    "priority": refused(1),
    "prompt_embeds": refused("AAAA"),
    "session_id": accepted("a conversation's id for the caller's records (vLLM routes by it); the prefix cache "
                           "is automatic, so it changes nothing here"),
    "watermarking": refused(True),
    "truncation_side": refused("left"),
    "logprob_token_ids": refused([1, 2]),
    "return_weight_versions": refused(True),
    "routed_experts_prompt_start": refused(3),
    "return_token_offsets": refused(True),
    "mm_payload": refused({"items": []}),
    "return_mm_kwargs": refused("yes"),
    "ec_transfer_params": refused({"a": 1}),
    "repetition_detection": refused({"max_pattern_size": 4}),
    "thinking_token_budget": refused(100),
    "stream_interval": refused(4),
}
COMPLETION_VLLM = {**SHARED_VLLM, "add_special_tokens": refused(False), "echo": honoured(
    f"{SURFACE}::test_echo_returns_the_prompt_first")}
CHAT_VLLM = {
    **SHARED_VLLM,
    "chat_template_kwargs": honoured(f"{APP}::test_chat_template_kwargs_reach_the_template"),
    "echo": refused(True),
    "add_generation_prompt": refused(False),
    "continue_final_message": refused(True),
    "add_special_tokens": refused(True),
    "documents": refused([{"text": "d"}]),
    "chat_template": refused("{{ messages }}"),
    "mm_processor_kwargs": refused({}),
    "media_io_kwargs": refused({"image": {}}),
    "return_prompt_text": refused(True),
    "include_reasoning": honoured(f"{REASONING}::test_include_reasoning_false_and_reasoning_parser_none_keep_it_out"),
    "reasoning_effort": honoured(f"{REASONING}::test_reasoning_effort_and_template_kwargs_reach_the_template"),
}
ENDPOINTS = {COMPLETIONS: ({**COMPLETION_OPENAI, **COMPLETION_VLLM}, CompletionRequest, completion_create_params),
             CHAT: ({**CHAT_OPENAI, **CHAT_VLLM}, ChatCompletionRequest, chat_create_params)}
BASE = {COMPLETIONS: {"prompt": "a b", "max_tokens": 2}, CHAT: {"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 2}}


def cases(kind: str):
    return [(path, name, evidence) for path, (fields, _, _) in ENDPOINTS.items()
            for name, (k, evidence) in sorted(fields.items()) if k == kind]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_the_lists_cover_openais_schema_and_every_declared_field(path):
    fields, struct, openai_params = ENDPOINTS[path]
    openai_fields = set(openai_params.CompletionCreateParamsBase.__annotations__)
    assert openai_fields - set(fields) == set(), "OpenAI fields missing from the list"
    declared = set(struct.__struct_fields__)
    assert set(fields) - declared == set(), "listed fields the server does not declare (it would drop them)"
    assert declared - set(fields) == set(), "declared fields missing from the list"


@pytest.mark.parametrize(("path", "name", "test"), cases("honoured"))
def test_an_honoured_field_names_a_behavioural_test_that_exists(path, name, test):
    module_path, function = test.split("::")
    module = importlib.import_module(module_path.removesuffix(".py").replace("/", "."))
    assert callable(getattr(module, function, None)), f"{name}: {test} does not exist"


@pytest.mark.parametrize(("path", "name", "reason"), cases("accepted"))
async def test_an_accepted_field_is_accepted(path, name, reason):
    engine = FakeEngine()
    r = await call(ServerApp(engine, manage_engine=False), "POST", path, {**BASE[path], name: "id-123"})
    assert r.status == 200, r.body
    assert reason


@pytest.mark.parametrize(("path", "name", "value"), cases("refused"))
async def test_a_refused_field_is_a_400_naming_it_and_queues_nothing(path, name, value):
    engine = FakeEngine()
    r = await call(ServerApp(engine, manage_engine=False), "POST", path, {**BASE[path], name: value})
    assert r.status == 400, r.body
    assert r.json()["error"]["param"] == name and name in r.json()["error"]["message"]
    assert engine.submitted == []


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_off_values_of_refused_fields_pass(path):
    """null, and the value that means "off" (vLLM's defaults), ask for nothing: they are not refused."""
    off = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
           "return_tokens_as_token_ids": False, "return_token_ids": False, "priority": 0,
           "guided_decoding_backend": "auto", "best_of": 1, "logits_processors": None,
           "watermarking": False, "return_weight_versions": False, "routed_experts_prompt_start": 0,
           "return_token_offsets": False, "return_mm_kwargs": True, "thinking_token_budget": -1, "stream_interval": 1}
    if path == CHAT:
        off.update(return_prompt_text=False)
        off.update(echo=False, add_generation_prompt=True, continue_final_message=False, add_special_tokens=False,
                   store=False, modalities=["text"], metadata={}, service_tier="auto")
    else:
        off.update(add_special_tokens=True, suffix="")
    engine = FakeEngine()
    r = await call(ServerApp(engine, manage_engine=False), "POST", path, {**BASE[path], **off})
    assert r.status == 200, r.body


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 4097}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(257)]},
     "tools"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": list(range(65_537))}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(65_537))}, "stop_token_ids"),
    ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}] * 4097}, "messages"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x"}] * 4097}, "messages"),
    ("/v1/responses", {"input": [{"role": "user", "content": "x"}] * 4097}, "input"),
])
async def test_counts_a_client_chooses_are_bounded_before_any_work(path, body, field):
    engine = FakeEngine()
    r = await call(ServerApp(engine, manage_engine=False), "POST", path, {"model": "fake-model", **body})
    assert r.status == 400 and field in r.body.decode()
    assert engine.submitted == [] and engine.prepared == []
