"""`metrale serve`: the OpenAI-compatible server on uvicorn (uvloop when installed).

`metrale.cli` adds the subcommand with `add_serve_parser(subparsers)`; `serve_main(argv)` runs it
alone (`python -m metrale.server`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Iterator

import uvicorn
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

from metrale.config import EngineConfig
from metrale.server.app import DEFAULT_MAX_BODY_BYTES, ServerApp

logger = logging.getLogger(__name__)
DESCRIPTION = """Serve a model over OpenAI's HTTP API (/v1/completions, /v1/chat/completions, /v1/models),
with /health and Prometheus /metrics.

    metrale serve --model PATH --host 127.0.0.1 --port 8000 [--api-key KEY] [--max-num-seqs N] ...

SIGTERM or SIGINT drains: new requests and /health get 503, in-flight requests run for up to
--shutdown-timeout seconds, the rest are aborted, and the process exits 0. A second signal exits at once.
"""


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `serve` subcommand; its `func` default runs it and returns the exit code."""
    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    parser.set_defaults(func=run_serve)
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve flags: engine configuration, then HTTP and lifecycle."""
    defaults = EngineConfig()
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default=None, help="GGUF file or model folder (default: SmolLM2-135M-Instruct)")
    engine.add_argument("--dtype", default=defaults.dtype, choices=("auto", "float32", "float16", "bfloat16"))
    engine.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="max running requests")
    engine.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                        help="max queued requests; more get HTTP 429")
    engine.add_argument("--max-model-len", type=int, default=defaults.max_model_len,
                        help="prompt + output tokens per request (default: the model's, capped at 8192)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    engine.add_argument("--kv-cache-mib", type=int, default=defaults.kv_cache_bytes >> 20,
                        help="KV cache pool size in MiB, allocated once at start")
    engine.add_argument("--block-size", type=int, default=defaults.block_size)
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--seed", type=int, default=defaults.seed)
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--api-key", default=os.environ.get("METRALE_API_KEY"),
                      help="require this bearer token on /v1/* (default: $METRALE_API_KEY)")
    http.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's)")
    http.add_argument("--model-alias", action="append", default=None, metavar="NAME",
                      help="another model id requests may name, answered as the served model (repeatable); "
                           "behind sglang-router use `--model-alias unknown`, the id it sends for a chat "
                           "request without \"model\"")
    http.add_argument("--default-max-tokens", type=int, default=512,
                      help="max_tokens of chat requests that set none (completions default to 16)")
    http.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="seconds in-flight requests may run after SIGTERM before they are aborted")
    http.add_argument("--access-log", action="store_true", help="log every HTTP request")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the serve flags describe (raises ValueError on bad values)."""
    return EngineConfig(model=args.model, dtype=args.dtype, kv_cache_bytes=args.kv_cache_mib << 20,
                        block_size=args.block_size, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_waiting=args.max_waiting, enable_prefix_caching=not args.no_prefix_caching,
                        seed=args.seed)


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
        """First signal: drain, then stop. Second: stop now."""
        if self._drain_task is None:
            logger.info("%s: draining for up to %.0f s", signal.Signals(sig).name, self.drain_timeout_s)
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        else:
            logger.warning("%s again: exiting without waiting", signal.Signals(sig).name)
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
    engine = AsyncEngine(engine_config(args), registry=registry)
    app = ServerApp(engine, api_key=args.api_key, served_model_name=args.served_model_name,
                    model_aliases=tuple(args.model_alias or ()),
                    max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens)
    config = uvicorn.Config(app, host=args.host, port=args.port, loop="auto", http="h11", lifespan="on",
                            access_log=args.access_log, timeout_graceful_shutdown=5,
                            log_level="info", log_config=None)
    server = DrainingServer(config, app, args.shutdown_timeout)
    app.on_fatal = server.fail
    server.run()
    # The engine is shut down and every request has ended. Exit without running C++ static
    # destructors: about 1 run in 20, a native thread torn down at interpreter exit aborted the
    # process ("terminate called without an active exception", SIGABRT) after a clean drain.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(server.exit_code)


def serve_main(argv: list[str] | None = None) -> int:
    """`metrale serve` as a standalone command (`python -m metrale.server ...`)."""
    parser = argparse.ArgumentParser(prog="metrale serve", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_serve(args)
