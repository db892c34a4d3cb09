"""What routers and gateways read from a replica, besides the OpenAI routes and /health.

    GET /server_info, /get_server_info   {"served_model_name", "model_path", ...}   sglang-router, at registration
    GET /model_info,  /get_model_info    {"model_path", "model_type", "is_generation"}
    (behind the API key when one is set, like every route but /health and /metrics)
    GET /get_load                        [{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]
    vLLM-named gauges appended to /metrics (vllm:num_requests_running|waiting, vllm:kv_cache_usage_perc)

sglang-router (`metrale fleet`, deploy/) needs only a 2xx /health; it names the worker's model from
`served_model_name` (else "unknown") and reads `model_type` as a label. `/get_load` feeds its
power_of_two policy (cache_aware counts in-flight requests itself): `num_tokens` is the KV cache
tokens held by running requests (queued prompts are not counted). Gateways that pick endpoints
from Prometheus (Gateway API inference extension, llm-d, KServe) look for vLLM's gauge names by
default; the aliases carry the same values as metrale_requests_running, metrale_requests_waiting
and metrale_kv_cache_usage_ratio (a 0..1 ratio, as vLLM's "perc" is).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from metrale import __version__
from metrale.outputs import EngineInfo, EngineStats

INFO_PATHS = ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load")
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def server_info(served_model_name: str, info: EngineInfo, max_model_len: int) -> dict[str, Any]:
    """GET /server_info: SGLang's field names where they exist (the router reads the first two).
    `model_path` is the served model's name: no response shows a filesystem path."""
    return {"served_model_name": served_model_name, "model_path": served_model_name, "model_type": info.model_type,
            "dtype": info.dtype, "max_model_len": max_model_len, "kv_block_size": info.kv_block_size,
            "engine": "metrale", "version": __version__}


def model_info(served_model_name: str, info: EngineInfo) -> dict[str, Any]:
    """GET /model_info: the model as SGLang describes it (HF `architectures` are not known for GGUF);
    `model_path` is the served model's name, as in server_info."""
    return {"model_path": served_model_name, "served_model_name": served_model_name, "model_type": info.model_type,
            "is_generation": True}


def load(stats: EngineStats, info: EngineInfo) -> list[dict[str, int]]:
    """GET /get_load: one entry per data-parallel rank (metrale has one), as SGLang reports it."""
    used_blocks = stats.kv_blocks_total - stats.kv_blocks_free
    return [{"dp_rank": 0, "num_reqs": stats.running + stats.waiting, "num_waiting_reqs": stats.waiting,
             "num_tokens": used_blocks * info.kv_block_size}]


def vllm_gauges(stats: EngineStats, model_name: str) -> bytes:
    """The scheduler gauges under vLLM's names, in the Prometheus text format (labelled model_name)."""
    values = (stats.running, stats.waiting, stats.kv_usage)
    docs = ("Requests in the running batch (alias of metrale_requests_running).",
            "Requests waiting to be scheduled (alias of metrale_requests_waiting).",
            "Fraction of KV cache blocks in use, 0..1 (alias of metrale_kv_cache_usage_ratio).")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot([_gauge(name, doc, model_name, value)
                                 for name, doc, value in zip(VLLM_GAUGES, docs, values)]))
    return generate_latest(registry)


def _gauge(name: str, doc: str, model_name: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


class _Snapshot:
    """A collector that yields fixed families (one scrape's worth)."""

    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self.families = families

    def collect(self) -> list[GaugeMetricFamily]:
        return self.families
