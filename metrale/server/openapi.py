"""GET /openapi.json: the server's routes as an OpenAPI 3.1 document, request bodies generated from the
msgspec request types (the same types that decode them), so the document cannot drift from the parser.

Every status a route can answer is listed; none of them is a catch-all "default". The 5xx ones are
documented for what they mean: 500 a request that failed inside the engine, 503 loading, draining or
unhealthy. A property-based fuzzer (tests/server/api_fuzz.py, Schemathesis) reads this document.
"""

from __future__ import annotations

from typing import Any

import msgspec

from metrale import __version__
from metrale.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from metrale.server.embeddings import EmbeddingRequest
from metrale.server.lora import LOAD_PATH, UNLOAD_PATH, LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from metrale.server.ollama_protocol import ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest, ModelRequest
from metrale.server.protocol import ChatCompletionRequest, CompletionRequest
from metrale.server.responses_protocol import ResponsesRequest
from metrale.server.tokenize import DetokenizeRequest, TokenizeRequest

_REF = "#/components/schemas/{name}"
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ERRORS = {"400": "invalid request (the message names the field)", "401": "missing or wrong API key",
           "403": "a Host or Origin this server does not answer", "404": "unknown route or model",
           "405": "wrong method", "408": "the body did not arrive in time", "413": "body over --max-body-bytes",
           "415": "body not declared as JSON", "429": "the waiting queue is full (Retry-After)",
           "500": "the request failed inside the engine", "503": "loading, draining or unhealthy (Retry-After)"}
# Anthropic's and Ollama's routes answer their own error shapes; the checks before any route (Host, Origin,
# key, method, body) answer OpenAI's.
_OTHER_ERRORS = {"anyOf": [{"$ref": "#/components/schemas/Error"}, {
    "type": "object", "required": ["type", "error"], "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"]}}}, {
    "type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}]}
_POST_ERRORS = ("400", "401", "403", "404", "408", "413", "415", "429", "500", "503")
_JSON, _SSE, _NDJSON = "application/json", "text/event-stream", "application/x-ndjson"
_POST_ROUTES = (  # path, operationId, body type, answer content types
    ("/v1/completions", "createCompletion", CompletionRequest, (_JSON, _SSE)),
    ("/v1/chat/completions", "createChatCompletion", ChatCompletionRequest, (_JSON, _SSE)),
    ("/v1/responses", "createResponse", ResponsesRequest, (_JSON, _SSE)),
    ("/v1/messages", "anthropicMessages", MessagesRequest, (_JSON, _SSE)),
    ("/v1/messages/count_tokens", "anthropicCountTokens", CountTokensRequest, (_JSON,)),
    ("/v1/embeddings", "createEmbedding", EmbeddingRequest, (_JSON,)),  # under --task embed
    ("/tokenize", "tokenize", TokenizeRequest, (_JSON,)),
    ("/detokenize", "detokenize", DetokenizeRequest, (_JSON,)),
    ("/api/chat", "ollamaChat", ChatRequest, (_JSON, _NDJSON)),
    ("/api/generate", "ollamaGenerate", GenerateRequest, (_JSON, _NDJSON)),
    ("/api/show", "ollamaShow", ModelRequest, (_JSON,)),
    ("/api/embed", "ollamaEmbed", EmbedRequest, (_JSON,)),  # under --task embed
    ("/api/embeddings", "ollamaEmbeddings", EmbeddingsRequest, (_JSON,)),
)
_LORA_ROUTES = (  # only with --enable-runtime-lora-updating
    (LOAD_PATH, "loadLoraAdapter", LoadLoraAdapterRequest, ("text/plain",)),
    (UNLOAD_PATH, "unloadLoraAdapter", UnloadLoraAdapterRequest, ("text/plain",)),
)
_OPENAI_SHAPED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/tokenize",
                  "/detokenize", LOAD_PATH, UNLOAD_PATH)
_OPEN_ROUTES = ("/health", "/metrics")


def openapi_document(*, api_key: bool, model: str, lora_routes: bool = False) -> dict[str, Any]:
    """The document; `api_key`: whether routes other than /health and /metrics need a bearer token;
    `model`: the served model's id (the example of /v1/models/{model}); `lora_routes`: the runtime LoRA
    load/unload routes are served."""
    routes = _POST_ROUTES + (_LORA_ROUTES if lora_routes else ())
    refs, schemas = msgspec.json.schema_components([route[2] for route in routes], ref_template=_REF)
    schemas = {**schemas, "Error": _ERROR}
    paths: dict[str, Any] = {}
    for (path, operation_id, _, answers), ref in zip(routes, refs):
        errors = _errors(*_POST_ERRORS) if path in _OPENAI_SHAPED else _errors(*_POST_ERRORS, schema=_OTHER_ERRORS)
        paths[path] = {"post": {
            "operationId": operation_id,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": {"200": {"description": "the answer, or its events when stream is true",
                                  "content": {kind: {"schema": {"type": "object"} if kind == _JSON else {}}
                                              for kind in answers}},
                          **errors}}}
    health_503 = {"description": '{"status": "loading" | "draining" | "unhealthy" | "stopped"}',
                  "content": {"application/json": {"schema": {"type": "object"}}}}
    paths.update({
        "/health": _get("getHealth", '{"status": "serving"}'),
        "/metrics": _get("getMetrics", "Prometheus text", content="text/plain"),
        "/v1/models": _get("listModels", "the served model", "401"),
        "/v1/models/{model}": {**_get("retrieveModel", "the model", "401", "404"),
                               "parameters": [{"name": "model", "in": "path", "required": True,
                                               "schema": {"type": "string"}, "example": model}]},
        "/openapi.json": _get("getOpenAPI", "this document", "401"),
        "/": _get("ollamaRoot", '"Ollama is running"', "401", content="text/plain"),
    })
    for path, operation_id in (("/api/version", "ollamaVersion"), ("/api/tags", "ollamaTags"),
                               ("/api/ps", "ollamaPs")):
        paths[path] = _get(operation_id, "Ollama's answer", "401", "503", errors=_OTHER_ERRORS)
    paths["/health"]["get"]["responses"]["503"] = health_503
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load"):
        paths[path] = _get(path.strip("/").replace("_", " ").title().replace(" ", ""), "see worker_api.py",
                           "401", "503")
    if api_key:
        for path, item in paths.items():
            for operation in (v for k, v in item.items() if k != "parameters"):
                operation["security"] = [] if path in _OPEN_ROUTES else [{"bearer": []}]
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "metrale", "version": __version__,
                 "description": "OpenAI-compatible LLM serving; see the README's HTTP API section"},
        "paths": paths, "components": {"schemas": schemas}}
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


def _get(operation_id: str, description: str, *statuses: str, content: str = _JSON,
         errors: dict[str, Any] | None = None) -> dict[str, Any]:
    schema = {"type": "string"} if content == "text/plain" else {}
    return {"get": {"operationId": operation_id,
                    "responses": {"200": {"description": description, "content": {content: {"schema": schema}}},
                                  **_errors("403", *statuses, schema=errors)}}}


def _errors(*statuses: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    schema = schema or {"$ref": _REF.format(name="Error")}
    return {s: {"description": _ERRORS[s], "content": {_JSON: {"schema": schema}}} for s in statuses}
