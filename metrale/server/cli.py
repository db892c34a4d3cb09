"""`metrale serve`: the OpenAI-compatible server on uvicorn (uvloop when installed).

`metrale.cli` adds the subcommand with `add_serve_parser(subparsers)`; `serve_main(argv)` runs it
alone (`python -m metrale.server`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
from typing import Iterator

import uvicorn
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest

from metrale.config import GENERATION_CONFIGS, KV_CACHE_DTYPES, EngineConfig
from metrale.manager.catalog import ModelEntry
from metrale.server.app import DEFAULT_MAX_BODY_BYTES, ServerApp
from metrale.server.connections import deadline_protocol
from metrale.server.chat_output import REASONING_FORMATS
from metrale.server.cors import parse_origins
from metrale.server.hosts import HostPolicy, parse_allowed_hosts
from metrale.server.lora import parse_lora_module
from metrale.server.managed import ManagedModels
from metrale.server.model_flags import ModelSpecs, add_many_models_arguments, models_from_flags, serves_many
from metrale.settings import RuntimeSettings
from metrale.text.output_parsing import CHOOSABLE

logger = logging.getLogger(__name__)
DESCRIPTION = """Serve a model over OpenAI's HTTP API (/v1/completions, /v1/chat/completions, /v1/models),
with /health and Prometheus /metrics.

    metrale serve --model PATH --host 127.0.0.1 --port 8000 [--api-key KEY] [--max-num-seqs N] ...

SIGTERM or SIGINT drains: new requests and /health get 503, in-flight requests run for up to
--shutdown-timeout seconds, the rest are aborted, and the process exits 0. A second signal forces the
exit: open requests are aborted (each stream ends with an error event), and the process exits 1. An
engine process that dies is restarted with the same config (its open requests end with an error,
new ones get 503 + Retry-After meanwhile, /health says "restarting"); when it keeps dying
(--max-engine-restarts) or an in-process engine dies, /health is 503 and the process exits 1 after
--dead-exit-grace seconds, so that systemd, compose, launchd or Kubernetes restart it.
"""


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `serve` subcommand; its `func` default runs it and returns the exit code."""
    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    parser.set_defaults(func=run_serve)
    return parser


# The server's step limit (an embedded engine has none by default: its chunks then do not depend on timing).
# Measured (benchmarks/results/long_prompt_sched.md): with 4 streams and an 8k prompt on 135M the streams'
# ITL p50 fell from 1.6 s to 135 ms at 1.00x TTFT for the prompt (quiet machine; 1.13-1.38x when busy); 1B with
# a 4k prompt: 3.5 s to 409 ms at 1.27x. A smaller factor costs the prompt more: 2x measured 2.9-5.4x TTFT
# (135M and 1B) and still gave a step p99 2.4-2.5x the streams' own decode-only p99 on a loaded machine.
SERVE_MAX_STEP_FACTOR = 8.0


def _factor_or_none(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve flags: engine configuration, then HTTP and lifecycle."""
    defaults = EngineConfig()
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", action=ModelSpecs, default=None, metavar="PATH | NAME=PATH",
                        help="GGUF file or model folder (default: SmolLM2-135M-Instruct); NAME=PATH (repeatable) "
                             "serves several models, each loaded on its first request")
    engine.add_argument("--dtype", default=defaults.dtype, choices=("auto", "float32", "float16", "bfloat16"))
    engine.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="max running requests")
    engine.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                        help="max queued requests; more get HTTP 429")
    engine.add_argument("--max-model-len", type=int, default=defaults.max_model_len,
                        help="prompt + output tokens per request (default: the model's, capped at 8192)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    engine.add_argument("--max-step-ms", type=float, default=defaults.max_step_ms,
                        help="time limit of a step that decodes: a long prompt's chunks shrink to fit it "
                             "(the streams keep their pace); omitted: no absolute limit")
    engine.add_argument("--max-step-factor", type=_factor_or_none, default=SERVE_MAX_STEP_FACTOR,
                        help="the streams' inter-token latency target while long prompts are processed, as a "
                             "multiple of their decode-only step: a step that decodes takes at most this many "
                             "times the measured time of its decodes alone (with --max-step-ms: the smaller limit "
                             "holds); a smaller factor slows the long prompt (its TTFT is at least K/(K-1) of its "
                             f"compute); 'none' turns it off (default: {SERVE_MAX_STEP_FACTOR:g})")
    engine.add_argument("--min-prefill-chunk", type=int, default=defaults.min_prefill_chunk,
                        help="prompt tokens a step's first chunk gets even over the step's time limit")
    engine.add_argument("--kv-cache-mib", type=int, default=defaults.kv_cache_bytes >> 20,
                        help="KV cache pool size in MiB, allocated once at start")
    engine.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype,
                        choices=KV_CACHE_DTYPES,
                        help="dtype of the KV pools (auto: float16 on CPU, the activations' dtype on GPU; int8: "
                             "int8 values with a float16 scale per 32, 1.88x float16's tokens, README: KV pool)")
    engine.add_argument("--block-size", type=int, default=defaults.block_size)
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--seed", type=int, default=defaults.seed)
    engine.add_argument("--generation-config", default=defaults.generation_config, choices=GENERATION_CONFIGS,
                        help="auto: a request's unset temperature / top_p / top_k / min_p / repetition_penalty take "
                             "the model's defaults (generation_config.json, GGUF general.sampling.*); vllm: ignore them")
    engine.add_argument("--task", default="generate", choices=("generate", "embed"),
                        help="generate: the completion, chat, responses, messages and Ollama chat/generate routes; "
                             "embed: /v1/embeddings and Ollama's /api/embed, /api/embeddings (the others answer 400)")
    engine.add_argument("--pooling", default=defaults.pooling, choices=("last", "mean", "cls"),
                        help="how --task embed pools the final hidden states: the last token's (decoder embedding "
                             "models such as Qwen3-Embedding), their mean, or the first token's")
    engine.add_argument("--matryoshka", action="store_true",
                        help="the model was trained for Matryoshka truncation: requests may ask for fewer dimensions")
    engine.add_argument("--tensor-parallel", type=int, default=defaults.tensor_parallel_size, metavar="N",
                        help="shard the model over N ranks on this machine (MLX ring backend on 127.0.0.1); "
                             "this process is rank 0 and starts the others")
    engine.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                             '\'{"method": "draft_model", "model": "small.gguf"}\' (default: off)')
    engine.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the scheduler, runner, kernels and grammar compiler in a child process that is "
                             "restarted when it dies (a native crash then costs only the requests in flight); "
                             "--no-engine-process runs them in the server process")
    engine.add_argument("--max-engine-restarts", type=int, default=defaults.max_engine_restarts, metavar="N",
                        help="engine process deaths survived within 10 minutes; one more makes the server exit 1")
    engine.add_argument("--lora-modules", action="append", default=None, metavar="NAME=PATH",
                        help="a LoRA adapter folder (mlx-lm or PEFT) served as model NAME (repeatable); also "
                             "vLLM's JSON form '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    engine.add_argument("--max-loras", type=int, default=defaults.max_loras,
                        help="LoRA adapters resident and running at once (LRU; a request for another waits)")
    engine.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank, help="largest adapter rank loaded")
    engine.add_argument("--max-lora-adapters", type=int, default=defaults.max_lora_adapters,
                        help="LoRA adapters registered at once (--lora-modules and /v1/load_lora_adapter together); "
                             "one more is a 400 naming the limit")
    engine.add_argument("--enable-runtime-lora-updating", action="store_true",
                        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (they read folders a "
                             "client names; the API key still applies)")
    add_many_models_arguments(parser)
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", action=_JoinHosts,
                      help="address to listen on; repeat it or give a comma list to listen on several at once "
                           "(e.g. --host 127.0.0.1 --host ::1), all on --port")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                      help="CORS: a comma list of origins browsers may call the API from, or * (default: none; "
                           "requests from other origins get 403); the API key is still required")
    http.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                      help="Host headers answered (DNS rebinding): a comma list of names and *.domain patterns, "
                           "or * for any; IP addresses, localhost and --host names always pass (default: those "
                           "only when listening on loopback, any Host otherwise)")
    http.add_argument("--api-key", default=None,
                      help="require this bearer token on every route but /health and /metrics "
                           "(default: $METRALE_API_KEY)")
    http.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's)")
    http.add_argument("--model-alias", action="append", default=None, metavar="NAME",
                      help="another model id requests may name, answered as the served model (repeatable); "
                           "behind sglang-router use `--model-alias unknown`, the id it sends for a chat "
                           "request without \"model\"")
    http.add_argument("--default-max-tokens", type=int, default=None,
                      help="max_tokens of chat requests that set none (default: the rest of the context; "
                           "completions default to 16)")
    http.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="seconds in-flight requests may run after SIGTERM before they are aborted")
    http.add_argument("--header-timeout", type=float, default=30.0,
                      help="seconds a request's line and headers may take before the connection is closed")
    http.add_argument("--body-timeout", type=float, default=30.0,
                      help="seconds a request body may take to arrive before a 408")
    http.add_argument("--dead-exit-grace", type=float, default=5.0,
                      help="seconds between the engine dying and the process exiting with status 1")
    http.add_argument("--access-log", action="store_true", help="log every HTTP request")
    http.add_argument("--tool-call-parser", default=None, choices=CHOOSABLE,
                      help="how the model writes tool calls (default: read from its chat template; \"generic\" "
                           "when it shows none)")
    http.add_argument("--vllm-metric-aliases", action="store_true",
                      help="also serve vllm:num_requests_running|waiting and vllm:kv_cache_usage_perc on /metrics, "
                           "for routers and gateways that read vLLM's names (metrale fleet turns it on)")
    http.add_argument("--reasoning-parser", default=None, choices=(*REASONING_FORMATS, "none"),
                      help="how the model marks its reasoning, split into reasoning_content (default: read "
                           "from its chat template; \"none\" leaves it in content)")


class _JoinHosts(argparse.Action):
    """--host may repeat: its values join into one comma list (replacing the default, not extending it)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest, values if current is self.default else f"{current},{values}")


def listen_hosts(value: str) -> list[str]:
    """The addresses of a --host value (a comma list), in order, without repeats."""
    hosts = list(dict.fromkeys(h.strip().removeprefix("[").removesuffix("]") for h in value.split(",") if h.strip()))
    if not hosts:
        raise ValueError(f"--host: no address in {value!r}")
    return hosts


def bind_sockets(hosts: list[str], port: int) -> list[socket.socket]:
    """One listening socket per address (IPv6 ones IPv6-only, so that :: and 0.0.0.0 can be listened on
    together); OSError naming the address that failed, with nothing left open."""
    sockets: list[socket.socket] = []
    try:
        for host in hosts:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            try:
                sockets.append(socket.create_server((host, port), family=family))
            except OSError as error:
                raise OSError(error.errno, f"cannot listen on {host} port {port}: {error.strerror}") from error
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the serve flags describe (raises ValueError on bad values); with many models, the
    config each model's engine starts from (its `model` is the entry's path)."""
    return EngineConfig(model=None if serves_many(args) else args.model, dtype=args.dtype,
                        kv_cache_bytes=args.kv_cache_mib << 20, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_step_ms=args.max_step_ms, max_step_factor=args.max_step_factor,
                        min_prefill_chunk=args.min_prefill_chunk,
                        max_waiting=args.max_waiting, enable_prefix_caching=not args.no_prefix_caching,
                        seed=args.seed, speculative_config=args.speculative_config,
                        tensor_parallel_size=args.tensor_parallel, generation_config=args.generation_config,
                        engine_process=args.engine_process, max_engine_restarts=args.max_engine_restarts,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_lora_adapters=args.max_lora_adapters, pooling=args.pooling,
                        matryoshka=args.matryoshka)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the engine before the server stops.

    uvicorn's own handling would close the listening socket at once (no 503 for new requests) and
    re-raise the signal after shutdown (exit status 143, not 0).
    """

    def __init__(self, config: uvicorn.Config, app: ServerApp, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain_timeout_s = drain_timeout_s
        self.exit_code = 0
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def on_signal(self, sig: int) -> None:
        """First signal: drain, then stop. Second: abort what is open (streams end with an error event)
        and stop with status 1. Third: stop at once."""
        name = signal.Signals(sig).name
        if self._drain_task is None:
            logger.info("%s: draining for up to %.0f s", name, self.drain_timeout_s)
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        elif self.exit_code == 0:
            logger.warning("%s again: forced exit; aborting the open requests (exit status 1)", name)
            self.exit_code = 1
            self.app.force_stop()
            self.should_exit = True
        else:
            self.should_exit = self.force_exit = True

    def fail(self) -> None:
        """Stop with exit status 1 (the engine could not start)."""
        self.exit_code = 1
        self.should_exit = True

    async def _drain(self) -> None:
        try:
            await self.app.drain(self.drain_timeout_s)
            logger.info("drained; shutting down")
        finally:
            self.should_exit = True


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until it is drained by a signal, then end the process with its exit code."""
    metrale_logger = logging.getLogger("metrale")
    if metrale_logger.getEffectiveLevel() > logging.INFO:
        metrale_logger.setLevel(logging.INFO)  # a server logs its lifecycle
    from metrale.engine.async_engine import AsyncEngine  # the heavy import (MLX) only when serving

    registry = CollectorRegistry()
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    try:
        engine_cfg = engine_config(args)
        settings = RuntimeSettings.resolve(engine_cfg, api_key=args.api_key)
        origins = parse_origins(args.allowed_origins)
        hosts = listen_hosts(args.host)
        host_policy = HostPolicy.for_listen(hosts, parse_allowed_hosts(args.allowed_hosts))
        lora_modules = tuple(parse_lora_module(text) for text in args.lora_modules or ())
        models = managed_models(args, engine_cfg, settings, registry) if serves_many(args) else None
    except ValueError as error:  # a bad flag value: say which, no traceback
        print(f"metrale serve: error: {error}", file=sys.stderr)
        return 2
    try:
        sockets = bind_sockets(hosts, args.port)
    except OSError as error:
        print(f"metrale serve: error: {error}", file=sys.stderr)
        return 1
    if models is not None:
        served: dict = {"models": models}
    else:
        served = {"engine": AsyncEngine(engine_cfg, registry=registry, settings=settings),
                  "served_model_name": args.served_model_name, "model_aliases": tuple(args.model_alias or ())}
    app = ServerApp(**served, api_key=settings.api_key,
                    max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                    body_timeout_s=args.body_timeout, dead_grace_s=args.dead_exit_grace,
                    tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                    allowed_origins=origins, allowed_hosts=host_policy,
                    vllm_metric_aliases=args.vllm_metric_aliases, lora_modules=lora_modules,
                    enable_runtime_lora_updating=args.enable_runtime_lora_updating, task=args.task)
    config = uvicorn.Config(app, host=hosts[0], port=args.port, loop="auto",
                            http=deadline_protocol(args.header_timeout),
                            lifespan="on",
                            access_log=args.access_log, timeout_graceful_shutdown=5,
                            log_level="info", log_config=None)
    server = DrainingServer(config, app, args.shutdown_timeout)
    app.on_fatal = server.fail
    logger.info("listening on %s", ", ".join(f"[{h}]:{args.port}" if ":" in h else f"{h}:{args.port}" for h in hosts))
    server.run(sockets=sockets)
    # The engine is shut down and every request has ended. Exit without the interpreter's teardown:
    # a thread's MLX random key destroyed during it once aborted the process after a clean drain
    # ("terminate called without an active exception"; kernels.runtime.release_thread_state).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(server.exit_code)


def managed_models(args: argparse.Namespace, engine_cfg: EngineConfig, settings: RuntimeSettings,
                   registry: CollectorRegistry) -> ManagedModels:
    """The models of --models / --model NAME=PATH, each served by an AsyncEngine when asked for."""
    from metrale.engine.async_engine import AsyncEngine

    def make_engine(entry: ModelEntry) -> AsyncEngine:
        return AsyncEngine(dataclasses.replace(engine_cfg, model=entry.path), settings=settings)

    return models_from_flags(args, engine_cfg, make_engine, lambda: generate_latest(registry))


def serve_main(argv: list[str] | None = None) -> int:
    """`metrale serve` as a standalone command (`python -m metrale.server ...`)."""
    parser = argparse.ArgumentParser(prog="metrale serve", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_serve(args)
