"""The OpenAI-compatible ASGI application: a small router over one AsyncEngine.

    GET  /health                 200 {"status": "serving"}; 503 while loading, draining or unhealthy
    GET  /metrics                Prometheus text from the engine's registry (+ vLLM-named gauge aliases)
    GET  /server_info /model_info /get_load (and /get_server_info, /get_model_info)
                                 what routers read from a replica: see worker_api.py
    GET  /v1/models[/{id}]       the models served (resolve.py: the one place a request's model is resolved), LoRA
                                 adapters included (parent: the base model, root: the adapter's folder)
    POST /v1/load_lora_adapter /v1/unload_lora_adapter   with --enable-runtime-lora-updating (lora.py)
    GET  /openapi.json           the routes and request bodies as OpenAPI 3.1 (see openapi.py)
    POST /v1/completions         see completions.py
    POST /v1/chat/completions
    POST /v1/responses           OpenAI's Responses API: see responses.py
    POST /v1/embeddings          see embeddings.py (with `task="embed"`, which refuses the generation routes)
    POST /v1/messages[/count_tokens]   Anthropic's Messages API: see anthropic.py
    POST /tokenize /detokenize   vLLM's token routes: see tokenize.py
    GET / and /api/*             Ollama's API (chat, generate, tags, show, ps, version): see ollama.py

Before any route: a Host this server does not answer (hosts.py, DNS rebinding) or an Origin that may
not call it (cors.py) is a 403; with an API key, every route but /health and /metrics needs it; POST
bodies must be JSON (415 otherwise: no preflight-free text/plain or form bodies).

Hand-written rather than a framework: a dozen routes, msgspec bodies, and direct control of the
ASGI `receive` channel, which the disconnect watcher needs. With `manage_engine` the app starts the
engine in the background at lifespan startup (so /health answers 503 "loading" meanwhile) and
shuts it down at lifespan shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST

from metrale.engine.protocol import EngineClient
from metrale.server import anthropic, completions, embeddings, lora, ollama, openapi, responses, tokenize, worker_api
from metrale.server.access import AccessControl, MethodNotAllowed
from metrale.server.asgi import (ClientDisconnected, Receive, Scope, Send, client_request_id, read_body, require_json,
                                 send_bytes, send_error, send_json)
from metrale.server.cors import CorsPolicy
from metrale.server.errors import APIError
from metrale.server.unknown_fields import UnknownFields
from metrale.server.hosts import HostPolicy
from metrale.server.resolve import ModelListing, ModelSet, SingleModel

logger = logging.getLogger(__name__)
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
_POST_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
RESPONSES_PATH = "/v1/responses"
TASKS = ("generate", "embed")  # what a server runs: its generation routes, or its embedding routes


class ServerApp:
    """ASGI app serving `engine` (any metrale.engine.protocol.EngineClient, e.g. an AsyncEngine) over
    OpenAI's HTTP API, or `models` (managed.ManagedModels: several models loaded on demand) instead.

    api_key: when set, every route but /health and /metrics requires `Authorization: Bearer <api_key>`.
    served_model_name: the model id clients use; the engine's model name by default.
    model_aliases: other model ids requests may name (answered as the served model), e.g. "unknown",
        which sglang-router sends for a chat request without "model".
    default_max_tokens: max_tokens of a chat request that sets none; None: the rest of the context
        (completions default to 16).
    body_timeout_s: a request body that has not fully arrived after this long gets a 408.
    tool_call_parser: how the model writes tool calls (a metrale.text.tool_parsers format); by default
        what the engine reads from the model's chat template.
    reasoning_parser: how the model marks its reasoning (a metrale.text.reasoning format, or "none" to
        leave it in content); by default what the engine reads from the chat template.
    allowed_origins: origins browsers may call the API from ("*" for any; see cors.py); others get 403.
    allowed_hosts: the Host headers answered (hosts.py); by default loopback names and IP addresses.
    vllm_metric_aliases: also serve the scheduler gauges under vLLM's names on /metrics (worker_api.py), for
        routers and gateways; off by default, as promtool rejects their `vllm:` names in an exposition.
    on_fatal: called (no arguments) when the engine fails to start or dies (after `dead_grace_s`),
        so the process can exit non-zero and its supervisor restart it.
    lora_modules: LoRA adapters registered once the engine has started (a bad one is a startup failure).
    enable_runtime_lora_updating: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (lora.py says why
        they are off by default).
    task: "generate" (completions, chat, responses, messages, Ollama chat/generate) or "embed" (/v1/embeddings,
        Ollama's /api/embed and /api/embeddings); the other task's routes answer a 400 naming the task.
    """

    def __init__(self, engine: EngineClient | None = None, *, models: ModelSet | None = None,
                 api_key: str | None = None, served_model_name: str | None = None,
                 model_aliases: tuple[str, ...] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 default_max_tokens: int | None = None,
                 body_timeout_s: float = 30.0, dead_grace_s: float = 5.0, manage_engine: bool = True,
                 tool_call_parser: str | None = None, allowed_origins: tuple[str, ...] = (),
                 reasoning_parser: str | None = None, allowed_hosts: HostPolicy | None = None,
                 on_fatal: Callable[[], None] | None = None, vllm_metric_aliases: bool = False,
                 lora_modules: tuple[lora.LoraModule, ...] = (), enable_runtime_lora_updating: bool = False,
                 task: str = "generate") -> None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        self.task = task
        if (engine is None) == (models is None):
            raise ValueError("ServerApp serves one engine or a set of models: give engine or models")
        if models is not None and (lora_modules or enable_runtime_lora_updating):
            raise ValueError("LoRA adapters run on the one engine of a one-model server, not on models loaded on "
                             "demand")
        self.models: ModelSet = models if models is not None else SingleModel(engine, served_model_name,
                                                                                tuple(model_aliases))
        self.engine = self.models.engine  # None when models load on demand
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens
        self.body_timeout_s = body_timeout_s
        self.dead_grace_s = dead_grace_s
        self.manage_engine = manage_engine
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.cors = CorsPolicy(tuple(allowed_origins))
        self.access = AccessControl(api_key, self.cors, allowed_hosts if allowed_hosts is not None else HostPolicy())
        self.on_fatal = on_fatal
        self.vllm_metric_aliases = vllm_metric_aliases
        self.lora_modules = tuple(lora_modules)
        self.enable_runtime_lora_updating = enable_runtime_lora_updating
        self.startup_error: BaseException | None = None
        self._start_task: asyncio.Task | None = None
        self._death_watch: asyncio.Task | None = None
        self._created = int(time.time())
        self._unknown_fields: UnknownFields | None = None
        self._openapi_document: dict[str, Any] | None = None

    @property
    def model_name(self) -> str:
        return self.models.model_id

    @property
    def unknown_fields(self) -> UnknownFields:
        """Counts the request fields no struct declares (made on first use: the model name is known by then)."""
        if self._unknown_fields is None:
            self._unknown_fields = UnknownFields(self.model_name)
        return self._unknown_fields

    def health(self) -> str:
        """"serving" | "loading" | "draining" | "unhealthy" | "stopped". Loading until the startup task has
        also registered the --lora-modules adapters: a client that waits for "serving" finds them all."""
        if self.startup_error is not None:
            return "unhealthy"
        if self._start_task is not None and not self._start_task.done():
            return "loading"
        return self.models.health()

    def force_stop(self) -> None:
        """Abort every open request now (a forced exit): each stream ends with an error event."""
        self.models.force_stop()

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting requests, let in-flight ones finish for up to timeout_s, abort the rest."""
        if self._start_task is not None and not self._start_task.done():
            return  # still loading: nothing in flight; shutdown cancels the load
        await self.models.drain(timeout_s)

    # ---- ASGI ----

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        else:
            raise RuntimeError(f"unsupported ASGI scope type {scope['type']!r}")

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.access.refusal(scope)
        if refusal is not None:  # no CORS headers: the page learns nothing
            return await send_error(send, refusal)
        started = False
        cors_headers = self.cors.response_headers(scope) if self.cors else []
        if self.cors and self.cors.is_preflight(scope):
            status, headers = self.cors.preflight(scope)
            return await send_bytes(send, status, b"", headers)

        extra_headers = [*cors_headers, *_request_id_header(scope)]

        async def tracked_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if extra_headers:
                    message = {**message, "headers": [*message.get("headers", []), *extra_headers]}
            await send(message)

        try:
            await self._route(scope, receive, tracked_send)
        except ClientDisconnected:
            logger.debug("client disconnected before sending its body")
        except APIError as error:
            if error.reject_reason is not None:
                self.models.record_rejected(error.reject_reason)
            if started:
                raise
            await send_error(tracked_send, error)
        except Exception:
            logger.exception("unhandled error serving %s %s", scope["method"], scope["path"])
            if started:
                raise
            await send_error(tracked_send, APIError(500, "internal server error", code="internal_error"))

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        self.access.authenticate(scope)
        if path == "/health":
            return await self._only(scope, self._health(send))
        if path == "/metrics":
            return await self._only(scope, self._metrics(send))
        if path in worker_api.INFO_PATHS:
            return await self._only(scope, self._worker_info(path, send))
        if path == "/openapi.json":
            return await self._only(scope, send_json(send, 200, self._openapi()))
        if path in tokenize.PATHS:
            body = await self._json_body(scope, receive)
            async with self.models.request_scope() as models:
                return await tokenize.handle(models, path, body, send)
        if ollama.serves(path):
            body = await self._json_body(scope, receive) if method == "POST" else b""
            async with self.models.request_scope() as models:
                return await ollama.handle(models, method, path, body, send, receive,
                                           request_id=client_request_id(scope), tool_call_format=self.tool_call_parser,
                                           reasoning_parser=self.reasoning_parser, task=self.task)
        if not path.startswith("/v1/"):
            raise APIError(404, f"no route for {path}", code="not_found")
        if method == "POST" and (path == embeddings.PATH or path in anthropic.PATHS or path in _POST_ROUTES
                                 or path == RESPONSES_PATH):
            self._check_task(path)  # another method is a 405 (read below)
        if path == embeddings.PATH:
            body = await self._json_body(scope, receive)
            async with self.models.request_scope() as models:
                return await embeddings.handle(models, body, send, receive, request_id=client_request_id(scope),
                                               unknown_fields=self.unknown_fields)
        if path in anthropic.PATHS:
            body = await self._json_body(scope, receive)
            async with self.models.request_scope() as models:
                return await anthropic.handle(models, path, body, send, receive,
                                              request_id=client_request_id(scope),
                                              tool_call_format=self.tool_call_parser,
                                              reasoning_parser=self.reasoning_parser)
        if path in _POST_ROUTES or path == RESPONSES_PATH:
            body = await self._json_body(scope, receive)
            options = {"default_max_tokens": self.default_max_tokens, "request_id": client_request_id(scope),
                       "tool_call_format": self.tool_call_parser,
                       "reasoning_parser": self.reasoning_parser, "unknown_fields": self.unknown_fields}
            async with self.models.request_scope() as models:
                if path == RESPONSES_PATH:
                    return await responses.handle(models, body, send, receive, **options)
                return await completions.handle(models, body, _POST_ROUTES[path], send, receive, **options)
        if path in lora.PATHS and self.enable_runtime_lora_updating:
            return await lora.handle(self.engine, path, await self._json_body(scope, receive), send)
        if path == "/v1/models":
            cards = [self._model_card(model) for model in self.models.listing()]
            return await self._only(scope, send_json(send, 200, {"object": "list", "data": cards}))
        if path.startswith("/v1/models/"):
            return await self._only(scope, self._one_model_card(path.removeprefix("/v1/models/"), send))
        raise APIError(404, f"no route for {path}", code="not_found")

    def _check_task(self, path: str) -> None:
        """A 400 for a route of the task this server does not run."""
        embedding = path == embeddings.PATH
        if embedding != (self.task == "embed"):
            needed = "embed" if embedding else "generate"
            raise APIError(400, f"this server runs task {self.task}; {path} needs a server started with "
                                f"--task {needed}", code="wrong_task", reject_reason="invalid_request")

    @staticmethod
    async def _only(scope: Scope, response: Any) -> None:
        """Send a GET route's `response` (a coroutine), or a 405 for any other method."""
        if scope["method"] != "GET":
            response.close()  # never awaited: release the coroutine
            raise MethodNotAllowed(scope["path"], scope["method"], "GET")
        await response

    async def _json_body(self, scope: Scope, receive: Receive) -> bytes:
        """The body of a POST route: 405 for another method, 415 unless declared JSON, 413 / 408 (read_body)."""
        if scope["method"] != "POST":
            raise MethodNotAllowed(scope["path"], scope["method"], "POST")
        require_json(scope)
        return await read_body(scope, receive, self.max_body_bytes, self.body_timeout_s)

    async def _health(self, send: Send) -> None:
        state = self.health()
        await send_json(send, 200 if state == "serving" else 503, {"status": state})

    @property
    def _started(self) -> bool:
        """The engine has loaded its model (max_model_len is 0 until then)."""
        return self.startup_error is None and self.engine is not None and self.engine.max_model_len > 0

    async def _metrics(self, send: Send) -> None:
        body = self.models.metrics_exposition() + self.unknown_fields.exposition()
        if self.vllm_metric_aliases and self._started:
            body += worker_api.vllm_gauges(self.engine.stats(), self.model_name)
        await send_bytes(send, 200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode())])

    async def _worker_info(self, path: str, send: Send) -> None:
        if self.engine is None:
            raise APIError(404, f"{path} describes one model; this server loads several on demand (see /v1/models)",
                           code="not_found")
        if not self._started:
            raise APIError(503, f"{path} is known once the model has loaded", code=self.health())
        info = self.engine.info()
        if path.endswith("server_info"):
            body: Any = worker_api.server_info(self.model_name, info, self.engine.max_model_len)
        elif path.endswith("model_info"):
            body = worker_api.model_info(self.model_name, info)
        else:
            body = worker_api.load(self.engine.stats(), info)
        await send_json(send, 200, body)

    def _openapi(self) -> dict[str, Any]:
        if self._openapi_document is None:
            self._openapi_document = openapi.openapi_document(api_key=self.access.needs_key, model=self.model_name,
                                                              lora_routes=self.enable_runtime_lora_updating)
        return self._openapi_document

    async def _one_model_card(self, requested: str, send: Send) -> None:
        for model in self.models.listing():
            if requested == model.model_id or requested in model.aliases:
                return await send_json(send, 200, self._model_card(model))
        raise APIError(404, f"model {requested!r} does not exist", param="model", code="model_not_found")

    def _model_card(self, model: ModelListing) -> dict[str, Any]:
        """vLLM's model card, with the other ids requests may use for the model (answered as it), and whether it is
        resident ("status": loaded | loading | unloaded | failed; its size on disk in bytes)."""
        return {"id": model.model_id, "object": "model", "created": self._created, "owned_by": "metrale",
                "root": model.path if model.parent is not None else model.model_id, "parent": model.parent,
                "max_model_len": model.engine.max_model_len if model.engine is not None else None,
                "aliases": list(model.aliases), "status": model.status, "size": model.size_bytes}

    # ---- lifespan ----

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.manage_engine:
                    self._start_task = asyncio.create_task(self._start_engine(), name="metrale-engine-start")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.manage_engine:
                    await self._stop_engine()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start_engine(self) -> None:
        try:
            await self.models.start()
            if self.engine is not None:
                await lora.register(self.engine, self.lora_modules, self.model_name)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logger.exception("engine failed to start")
            self.startup_error = error
            if self.on_fatal is not None:
                self.on_fatal()
            return
        if self.engine is not None:
            logger.info("serving model %s (max_model_len %d)", self.model_name, self.engine.max_model_len)
        else:
            logger.info("serving %d models, loaded on demand", len(self.models.listing()))
        self._death_watch = asyncio.create_task(self._watch_for_death(), name="metrale-engine-death-watch")

    async def _watch_for_death(self) -> None:
        """A dead engine cannot recover in this process: after a grace period (so clients get their
        503s and error events), ask the process to exit non-zero so that its supervisor restarts it."""
        error = await self.models.wait_until_dead()
        if error is None:
            return  # shut down cleanly
        logger.critical("engine died (%s: %s); exiting in %.0f s so the supervisor restarts the server",
                        type(error).__name__, error, self.dead_grace_s)
        await asyncio.sleep(self.dead_grace_s)
        if self.on_fatal is not None:
            self.on_fatal()

    async def _stop_engine(self) -> None:
        for task in (self._start_task, self._death_watch):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.models.shutdown()


def _request_id_header(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The client's X-Request-Id, echoed on the response (the openai SDK reads it); none when absent or malformed
    (a malformed one is refused with a 400 by the route that reads it)."""
    try:
        request_id = client_request_id(scope)
    except APIError:
        return []
    return [(b"x-request-id", request_id.encode())] if request_id is not None else []
