"""EngineMetrics driven directly: names, units, buckets, counts, and the finish/abort paths."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metrale.engine.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineMetrics,
    FinishedRequestStats,
    IterationStats,
    build_1_2_5_buckets,
)

MODEL = {"model_name": "tiny"}


def _step(running=1, waiting=0, usage=0.25, prompt=0, gen=1, batched=1, ttfts=(), itls=(),
          preempt=0, queries=0, hits=0) -> IterationStats:
    return IterationStats(num_running=running, num_waiting=waiting, kv_cache_usage=usage,
                          num_prompt_tokens=prompt, num_generation_tokens=gen, num_batched_tokens=batched,
                          time_to_first_tokens_s=ttfts, inter_token_latencies_s=itls,
                          num_preemptions=preempt, prefix_cache_queries=queries, prefix_cache_hits=hits)


def _finished(reason="length", gen=4, prefill=0.2, decode=0.6) -> FinishedRequestStats:
    return FinishedRequestStats(finish_reason=reason, e2e_latency_s=1.0, queue_time_s=0.1,
                                prefill_time_s=prefill, decode_time_s=decode,
                                num_prompt_tokens=7, num_generation_tokens=gen)


@pytest.fixture
def metrics() -> EngineMetrics:
    metrics = EngineMetrics(CollectorRegistry(), model_name="tiny")
    metrics.set_max_model_len(2048)
    return metrics


def value(m: EngineMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {**MODEL, **labels})


def test_fresh_registry_by_default_never_the_global_one():
    before = set(REGISTRY._names_to_collectors)
    a, b = EngineMetrics(model_name="x"), EngineMetrics(model_name="x")  # no duplicate-name clash
    assert a.registry is not b.registry and a.registry is not REGISTRY
    assert set(REGISTRY._names_to_collectors) == before


def test_names_follow_prometheus_conventions(metrics):
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    expected = {
        "metrale_requests_running": "gauge", "metrale_requests_waiting": "gauge",
        "metrale_kv_cache_usage_ratio": "gauge", "metrale_build_info": "gauge",
        "metrale_prompt_tokens": "counter", "metrale_generation_tokens": "counter",
        "metrale_request_success": "counter", "metrale_num_preemptions": "counter",
        "metrale_prefix_cache_queries": "counter", "metrale_prefix_cache_hits": "counter",
        "metrale_requests_rejected": "counter",
        "metrale_time_to_first_token_seconds": "histogram", "metrale_inter_token_latency_seconds": "histogram",
        "metrale_e2e_request_latency_seconds": "histogram", "metrale_request_queue_time_seconds": "histogram",
        "metrale_request_prefill_time_seconds": "histogram", "metrale_request_decode_time_seconds": "histogram",
        "metrale_request_prompt_tokens": "histogram", "metrale_request_generation_tokens": "histogram",
        "metrale_iteration_tokens": "histogram",
        "metrale_prompt_tokens_cached": "counter", "metrale_prompt_tokens_by_source": "counter",
        "metrale_request_params_n": "histogram", "metrale_request_params_max_tokens": "histogram",
        "metrale_request_time_per_output_token_seconds": "histogram",
        "metrale_request_inference_time_seconds": "histogram",
        "metrale_request_max_num_generation_tokens": "histogram", "metrale_request_num_preemptions": "histogram",
    }
    assert {name: families[name].type for name in expected} == expected
    for family in families.values():
        assert ":" not in family.name
        for sample in family.samples:
            if family.name != "metrale_build_info":  # an info metric's labels are its value
                assert set(sample.labels) <= {"model_name", "finished_reason", "reason", "source", "le"}, sample


def test_buckets_are_vllms(metrics):
    def uppers(name):
        return [float(s.labels["le"]) for s in metrics.registry.collect() if s.name == name
                for s in s.samples if s.name.endswith("_bucket")][:-1]  # drop +Inf
    assert uppers("metrale_time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert uppers("metrale_inter_token_latency_seconds") == list(ITL_BUCKETS)
    assert uppers("metrale_e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert uppers("metrale_request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(1) == (1,) and build_1_2_5_buckets(50)[-1] == 50
    with pytest.raises(ValueError, match="max_value"):
        build_1_2_5_buckets(0)


def test_counts_for_n_requests_of_m_tokens(metrics):
    """N requests x M tokens, prompt P: one prefill step (first tokens), then M-1 decode steps."""
    n, m, p = 3, 5, 7
    metrics.record_iteration(_step(running=n, prompt=n * p, gen=n, batched=n * p, ttfts=(0.05,) * n))
    for _ in range(m - 1):
        metrics.record_iteration(_step(running=n, gen=n, batched=n, itls=(0.02,) * n))
    for _ in range(n):
        metrics.record_finished(_finished("length", gen=m))
    metrics.set_gauges(0, 0, 0.0)
    assert value(metrics, "metrale_time_to_first_token_seconds_count") == n
    assert value(metrics, "metrale_inter_token_latency_seconds_count") == n * (m - 1)
    assert value(metrics, "metrale_generation_tokens_total") == n * m
    assert value(metrics, "metrale_prompt_tokens_total") == n * p
    assert value(metrics, "metrale_request_success_total", finished_reason="length") == n
    assert value(metrics, "metrale_request_success_total", finished_reason="stop") == 0
    assert value(metrics, "metrale_iteration_tokens_sum") == n * (p + m - 1)
    assert value(metrics, "metrale_request_generation_tokens_sum") == n * m
    assert value(metrics, "metrale_e2e_request_latency_seconds_count") == n
    assert value(metrics, "metrale_requests_running") == 0


def test_aborted_and_failed_requests_use_the_same_finish_path(metrics):
    metrics.record_iteration(_step(running=2, waiting=1, usage=0.5, gen=2, batched=2))
    metrics.record_finished(_finished("abort", gen=0, prefill=0.0, decode=0.0))  # aborted while waiting
    metrics.record_finished(_finished("error", gen=2))
    metrics.record_finished(_finished("abort", gen=3))
    metrics.set_gauges(0, 0, 0.0)
    assert value(metrics, "metrale_request_success_total", finished_reason="abort") == 2
    assert value(metrics, "metrale_request_success_total", finished_reason="error") == 1
    assert value(metrics, "metrale_e2e_request_latency_seconds_count") == 3
    assert value(metrics, "metrale_request_prefill_time_seconds_count") == 2  # no phase, no sample
    assert value(metrics, "metrale_request_decode_time_seconds_count") == 2
    for gauge in ("metrale_requests_running", "metrale_requests_waiting", "metrale_kv_cache_usage_ratio"):
        assert value(metrics, gauge) == 0


def test_preemptions_prefix_cache_and_idle_steps(metrics):
    metrics.record_iteration(_step(prompt=32, gen=0, batched=32, preempt=1, queries=48, hits=16))
    metrics.record_iteration(_step(gen=0, batched=0))  # nothing computed: no iteration sample
    assert value(metrics, "metrale_num_preemptions_total") == 1
    assert value(metrics, "metrale_prefix_cache_queries_total") == 48
    assert value(metrics, "metrale_prefix_cache_hits_total") == 16
    assert value(metrics, "metrale_iteration_tokens_count") == 1


def test_rejections_by_reason(metrics):
    for reason in ("queue_full", "queue_full", "too_long", "draining", "invalid_request"):
        metrics.record_rejected(reason)
    assert value(metrics, "metrale_requests_rejected_total", reason="queue_full") == 2
    assert value(metrics, "metrale_requests_rejected_total", reason="draining") == 1
    with pytest.raises(ValueError, match="reject reason 'nope'"):
        metrics.record_rejected("nope")


def test_prompt_tokens_are_whole_prompts_with_the_cached_part_by_source(metrics):
    """vLLM's prompt_tokens: the whole prompt (counted when its first token comes), cached tokens included and
    also counted apart; by source, local_compute + local_cache_hit = prompt_tokens."""
    metrics.record_iteration(IterationStats(num_running=2, num_waiting=0, kv_cache_usage=0.1, num_prompt_tokens=40,
                                            num_generation_tokens=2, num_batched_tokens=26,
                                            num_cached_prompt_tokens=16))
    assert value(metrics, "metrale_prompt_tokens_total") == 40
    assert value(metrics, "metrale_prompt_tokens_cached_total") == 16
    assert value(metrics, "metrale_prompt_tokens_by_source_total", source="local_compute") == 24
    assert value(metrics, "metrale_prompt_tokens_by_source_total", source="local_cache_hit") == 16
    assert value(metrics, "metrale_prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    with pytest.raises(ValueError, match="num_cached_prompt_tokens 5 > num_prompt_tokens 4"):
        metrics.record_iteration(IterationStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                                                num_prompt_tokens=4, num_generation_tokens=0, num_batched_tokens=0,
                                                num_cached_prompt_tokens=5))


def test_per_request_series_and_n_observed_once_per_request(metrics):
    """A request of n=2 ends as two sequences (each a finished request, as in vLLM); n, max_tokens and the
    longest sequence are observed once, with the last one; time per output token = decode / (tokens - 1)."""
    base = dict(finish_reason="length", e2e_latency_s=1.0, queue_time_s=0.1, prefill_time_s=0.2, decode_time_s=0.6,
                num_prompt_tokens=7, inference_time_s=0.8, max_tokens_param=7)
    metrics.record_finished(FinishedRequestStats(**base, num_generation_tokens=4, num_preemptions=2))
    metrics.record_finished(FinishedRequestStats(**base, num_generation_tokens=7, params_n=2,
                                                 max_num_generation_tokens=7))
    assert value(metrics, "metrale_request_success_total", finished_reason="length") == 2
    assert value(metrics, "metrale_request_params_n_count") == 1 and value(metrics, "metrale_request_params_n_sum") == 2
    assert value(metrics, "metrale_request_max_num_generation_tokens_sum") == 7
    assert value(metrics, "metrale_request_max_num_generation_tokens_count") == 1
    assert value(metrics, "metrale_request_params_max_tokens_count") == 2
    assert value(metrics, "metrale_request_inference_time_seconds_sum") == pytest.approx(1.6)
    assert value(metrics, "metrale_request_time_per_output_token_seconds_sum") == pytest.approx(0.2 + 0.1)
    assert value(metrics, "metrale_request_num_preemptions_sum") == 2
    assert value(metrics, "metrale_request_num_preemptions_count") == 2


def test_build_info_carries_the_version(metrics):
    from metrale import __version__

    assert value(metrics, "metrale_build_info", version=__version__) == 1


def test_info_metric(metrics):
    metrics.set_info(version="0.1.0", block_size=16)
    assert value(metrics, "metrale_build_info", version="0.1.0", block_size="16") == 1
    metrics.set_info(version="0.2.0")  # replaces the label set
    assert value(metrics, "metrale_build_info", version="0.1.0", block_size="16") is None


@pytest.mark.parametrize("bad, match", [
    (lambda m: m.set_gauges(1, 0, 1.5), "kv_cache_usage must be in"),
    (lambda m: m.set_gauges(-1, 0, 0.0), "counts must be >= 0"),
    (lambda m: m.record_iteration(_step(gen=-1)), "counts must be >= 0"),
    (lambda m: m.record_iteration(_step(queries=1, hits=2)), "prefix_cache_hits 2 > prefix_cache_queries 1"),
    (lambda m: m.record_finished(_finished("cancelled")), "finish_reason 'cancelled'"),
])
def test_misuse_raises_with_numbers(metrics, bad, match):
    with pytest.raises(ValueError, match=match):
        bad(metrics)


def test_stats_are_frozen_value_objects():
    stats = _step()
    with pytest.raises(AttributeError):
        stats.num_running = 3  # type: ignore[misc]
    assert stats == _step() and not hasattr(stats, "__dict__")
