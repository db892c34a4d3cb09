"""Prometheus metrics for the engine: names, units and buckets in one place.

The engine owns one `EngineMetrics` and reports to it through four calls, all on the event-loop
thread (no locks): `record_iteration` once per step, `record_finished` once per finished request
(success, abort and error alike, the same finish path), `record_rejected` once per request refused at
submit time, and `set_gauges` when idle. The registry is injected, so a service that embeds the engine
scrapes it with its own registry, and tests get a fresh one each; the global default registry is used
only when it is passed in explicitly.

Naming follows Prometheus conventions: `metrale_` prefix, base units (`_seconds`), `_total` on
counters, 0..1 `_ratio` gauges, and no per-request labels (only `model_name`, plus `finished_reason`
and `reason` with small fixed value sets). Buckets are vLLM's, so its dashboards port by renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from metrale import __version__

FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("queue_full", "invalid_request", "too_long", "draining")

# Buckets (seconds unless named otherwise), as vLLM v1's PrometheusStatLogger.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM's; the last is always 0


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """[1, 2, 5, 10, 20, 50, ...] up to and including `max_value` (vLLM's token-count buckets)."""
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


@dataclass(frozen=True, slots=True)
class IterationStats:
    """What one engine step did. Token counts and latencies are for this step only."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, after the step
    num_prompt_tokens: int  # whole prompts (cached tokens included) of the requests that got a first token this step
    num_generation_tokens: int  # tokens sampled this step
    num_batched_tokens: int  # all tokens in the step's forward pass
    time_to_first_tokens_s: tuple[float, ...] = ()  # one per request that got its first token
    inter_token_latencies_s: tuple[float, ...] = ()  # one per token gap
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # tokens found there
    num_cached_prompt_tokens: int = 0  # of num_prompt_tokens, those the prefix cache served (not computed)


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One finished request (any finish reason). Phase times are 0.0 for phases it never reached."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency_s: float  # arrival -> finish
    queue_time_s: float  # arrival -> first scheduled
    prefill_time_s: float  # first scheduled -> first token
    decode_time_s: float  # first token -> last token
    num_prompt_tokens: int
    num_generation_tokens: int
    inference_time_s: float = 0.0  # first scheduled -> last token (preemptions included)
    num_preemptions: int = 0
    max_tokens_param: int | None = None  # the effective max_tokens (set or chosen); None: not observed
    params_n: int | None = None  # on the last sequence of a request to end: its n (vLLM's parent request)
    max_num_generation_tokens: int | None = None  # with params_n: the longest of its sequences, in tokens


class EngineMetrics:
    """All `metrale_*` series of one engine, registered in one registry.

    `registry` None means a fresh `CollectorRegistry` (never the process-global default unless it is
    passed). The prompt and generation length histograms have 1-2-5 buckets up to the engine's
    max_model_len, which is known only once the model is loaded: `set_max_model_len` registers them
    then (a length observed before is an error).
    """

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "metrale") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        reg, label = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=reg).labels(model_name)

        histogram = self._histogram

        self._running = gauge("metrale_requests_running", "Requests in the running batch.")
        self._waiting = gauge("metrale_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = gauge("metrale_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).")
        self._prompt_tokens = counter("metrale_prompt_tokens", "Prompt tokens of requests that got their first "
                                      "token, cached ones included (vLLM's prompt_tokens).")
        self._prompt_tokens_cached = counter("metrale_prompt_tokens_cached",
                                             "Of metrale_prompt_tokens, those served by the prefix cache.")
        by_source = Counter("metrale_prompt_tokens_by_source", "Prompt tokens by where their KV came from: "
                            "local_compute, local_cache_hit, external_kv_transfer (always 0).",
                            ["model_name", "source"], registry=reg)
        self._prompt_tokens_by_source = {source: by_source.labels(model_name, source)
                                         for source in PROMPT_TOKEN_SOURCES}
        self._generation_tokens = counter("metrale_generation_tokens", "Tokens generated.")
        self._preemptions = counter("metrale_num_preemptions", "Requests preempted for recompute.")
        self._prefix_queries = counter("metrale_prefix_cache_queries",
                                       "Prompt tokens looked up in the prefix cache.")
        self._prefix_hits = counter("metrale_prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter("metrale_request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=reg)
        self._success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        rejected = Counter("metrale_requests_rejected", "Requests refused at submit time, by reason.",
                           ["model_name", "reason"], registry=reg)
        self._rejected = {r: rejected.labels(model_name, r) for r in REJECT_REASONS}

        self._ttft = histogram("metrale_time_to_first_token_seconds",
                               "Arrival to first generated token.", TTFT_BUCKETS)
        self._itl = histogram("metrale_inter_token_latency_seconds",
                              "Time between consecutive generated tokens of a request.", ITL_BUCKETS)
        self._e2e = histogram("metrale_e2e_request_latency_seconds",
                              "Arrival to finish, any finish reason.", REQUEST_LATENCY_BUCKETS)
        self._queue = histogram("metrale_request_queue_time_seconds",
                                "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS)
        self._prefill = histogram("metrale_request_prefill_time_seconds",
                                  "First scheduled to first token.", REQUEST_LATENCY_BUCKETS)
        self._decode = histogram("metrale_request_decode_time_seconds",
                                 "First token to last token.", REQUEST_LATENCY_BUCKETS)
        self._inference = histogram("metrale_request_inference_time_seconds",
                                    "First scheduled to last token (preemptions included).", REQUEST_LATENCY_BUCKETS)
        self._tpot = histogram("metrale_request_time_per_output_token_seconds", "Decode time of a request divided "
                               "by its generated tokens after the first.", ITL_BUCKETS)
        self._params_n = histogram("metrale_request_params_n", "The n (sequences) of finished requests.",
                                   REQUEST_PARAMS_N_BUCKETS)
        self._request_preemptions = histogram("metrale_request_num_preemptions",
                                              "Times a finished request was preempted.",
                                              REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self._params_max_tokens: Histogram | None = None
        self._max_generation_len: Histogram | None = None
        self._prompt_len: Histogram | None = None  # set_max_model_len registers the length histograms
        self._generation_len: Histogram | None = None
        self._iteration_tokens = histogram("metrale_iteration_tokens",
                                           "Tokens in one engine step's forward pass.", ITERATION_TOKEN_BUCKETS)
        self._restarts = counter("metrale_engine_restarts",
                                 "Engine processes started again after the previous one died.")
        self._hangs = counter("metrale_engine_hangs",
                              "Engine processes killed because they stopped answering: no heartbeat, or a step "
                              "stuck (each is then restarted, and counted in metrale_engine_restarts too).")
        self._info = Info("metrale_build", "metrale build and engine configuration (value is always 1).",
                          registry=reg)
        self._info.info({"model_name": model_name, "version": __version__})

    def record_engine_restart(self) -> None:
        """Count one restart of a dead engine process."""
        self._restarts.inc()

    def record_engine_hang(self) -> None:
        """Count one engine process killed by the hang watch (metrale.engine.hang_watch)."""
        self._hangs.inc()

    def enable_speculation(self, num_speculative_tokens: int) -> None:
        """Register the speculative-decoding series (vLLM's spec_decode family), positions 0..k-1."""
        reg, name = self.registry, self.model_name
        self._spec_verified = Counter("metrale_spec_decode_num_drafts", "Draft runs verified (one per request "
                                      "per step that speculated).", ["model_name"], registry=reg).labels(name)
        self._spec_drafts = Counter("metrale_spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                                    ["model_name"], registry=reg).labels(name)
        self._spec_accepted = Counter("metrale_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                      ["model_name"], registry=reg).labels(name)
        per_pos = Counter("metrale_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position "
                          "in the draft (0 is the first).", ["model_name", "position"], registry=reg)
        drafts_pos = Counter("metrale_spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed, by position "
                             "(acceptance rate per position = accepted_per_pos / draft_tokens_per_pos).",
                             ["model_name", "position"], registry=reg)
        self._spec_accepted_pos = [per_pos.labels(name, str(i)) for i in range(num_speculative_tokens)]
        self._spec_drafts_pos = [drafts_pos.labels(name, str(i)) for i in range(num_speculative_tokens)]

    def record_speculation(self, num_verified: int, num_drafts: int, num_accepted: int,
                           drafts_per_position: list[int], accepted_per_position: list[int]) -> None:
        """Account one step's verifications (after enable_speculation)."""
        _check_counts(num_verified, num_drafts, num_accepted)
        if num_accepted > num_drafts:
            raise ValueError(f"accepted {num_accepted} > drafts {num_drafts}")
        self._spec_verified.inc(num_verified)
        self._spec_drafts.inc(num_drafts)
        self._spec_accepted.inc(num_accepted)
        for counter, count in zip(self._spec_drafts_pos, drafts_per_position):
            counter.inc(count)
        for counter, count in zip(self._spec_accepted_pos, accepted_per_position):
            counter.inc(count)

    def set_max_model_len(self, max_model_len: int) -> None:
        """Register the length histograms with buckets up to `max_model_len` (once, at engine start)."""
        if self._prompt_len is not None:
            raise RuntimeError("set_max_model_len was already called")
        buckets = build_1_2_5_buckets(max_model_len)
        self._prompt_len = self._histogram("metrale_request_prompt_tokens",
                                           "Prompt length of finished requests, in tokens.", buckets)
        self._generation_len = self._histogram("metrale_request_generation_tokens",
                                               "Generated length of finished requests, in tokens.", buckets)
        self._params_max_tokens = self._histogram("metrale_request_params_max_tokens",
                                                  "The max_tokens of finished requests that set one.", buckets)
        self._max_generation_len = self._histogram("metrale_request_max_num_generation_tokens", "The longest "
                                                   "sequence of each finished request (of its n), in tokens.",
                                                   buckets)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(self.model_name)

    def record_iteration(self, stats: IterationStats) -> None:
        """Account one engine step: gauges, token counters, TTFT and ITL samples, step size."""
        self.set_gauges(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        _check_counts(stats.num_prompt_tokens, stats.num_generation_tokens, stats.num_batched_tokens,
                      stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits,
                      stats.num_cached_prompt_tokens)
        if stats.num_cached_prompt_tokens > stats.num_prompt_tokens:
            raise ValueError(f"num_cached_prompt_tokens {stats.num_cached_prompt_tokens} > "
                             f"num_prompt_tokens {stats.num_prompt_tokens}")
        if stats.prefix_cache_hits > stats.prefix_cache_queries:
            raise ValueError(f"prefix_cache_hits {stats.prefix_cache_hits} > "
                             f"prefix_cache_queries {stats.prefix_cache_queries}")
        self._prompt_tokens.inc(stats.num_prompt_tokens)
        self._prompt_tokens_cached.inc(stats.num_cached_prompt_tokens)
        self._prompt_tokens_by_source["local_compute"].inc(stats.num_prompt_tokens - stats.num_cached_prompt_tokens)
        self._prompt_tokens_by_source["local_cache_hit"].inc(stats.num_cached_prompt_tokens)
        self._generation_tokens.inc(stats.num_generation_tokens)
        self._preemptions.inc(stats.num_preemptions)
        self._prefix_queries.inc(stats.prefix_cache_queries)
        self._prefix_hits.inc(stats.prefix_cache_hits)
        for ttft in stats.time_to_first_tokens_s:
            self._ttft.observe(ttft)
        for itl in stats.inter_token_latencies_s:
            self._itl.observe(itl)
        if stats.num_batched_tokens > 0:  # a step that computed nothing is not a sample
            self._iteration_tokens.observe(stats.num_batched_tokens)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        """Account one finished request, whatever its finish reason.

        Latency and length samples are always taken; prefill, decode and inference time and the time per
        output token only for a request that produced a token (one that never got that far has no such
        phase, not a zero-long one). As in vLLM, each of a request's n sequences is one finished request here;
        the request itself (n and its longest sequence) is observed once, on its last sequence (`params_n`).
        """
        success = self._success.get(stats.finish_reason)
        if success is None:
            raise ValueError(f"finish_reason {stats.finish_reason!r} not in {FINISH_REASONS}")
        _check_counts(stats.num_prompt_tokens, stats.num_generation_tokens, stats.num_preemptions)
        success.inc()
        self._request_preemptions.observe(stats.num_preemptions)
        self._e2e.observe(stats.e2e_latency_s)
        self._queue.observe(stats.queue_time_s)
        if stats.num_generation_tokens > 0:
            self._prefill.observe(stats.prefill_time_s)
            self._decode.observe(stats.decode_time_s)
            self._inference.observe(stats.inference_time_s)
            after_first = stats.num_generation_tokens - 1
            self._tpot.observe(stats.decode_time_s / after_first if after_first > 0 else 0.0)
        if self._prompt_len is None or self._generation_len is None:
            raise RuntimeError("record_finished before set_max_model_len: the length buckets are not known yet")
        self._prompt_len.observe(stats.num_prompt_tokens)
        self._generation_len.observe(stats.num_generation_tokens)
        if stats.max_tokens_param is not None and self._params_max_tokens is not None:
            self._params_max_tokens.observe(stats.max_tokens_param)
        if stats.params_n is not None:
            self._params_n.observe(stats.params_n)
            if self._max_generation_len is not None and stats.max_num_generation_tokens is not None:
                self._max_generation_len.observe(stats.max_num_generation_tokens)

    def record_rejected(self, reason: str) -> None:
        """Count one request refused before it was queued (`reason` in REJECT_REASONS)."""
        counter = self._rejected.get(reason)
        if counter is None:
            raise ValueError(f"reject reason {reason!r} not in {REJECT_REASONS}")
        counter.inc()

    def set_gauges(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Set the scheduler-state gauges (also used to refresh them while idle)."""
        _check_counts(num_running, num_waiting)
        if not 0.0 <= kv_cache_usage <= 1.0:
            raise ValueError(f"kv_cache_usage must be in [0, 1], got {kv_cache_usage}")
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv_usage.set(kv_cache_usage)

    def set_info(self, **labels: object) -> None:
        """Set the labels of `metrale_build_info` (version, block_size, ...); values become strings.

        `model_name` and metrale's `version` are always included; each call replaces the previous label set.
        """
        values = {"model_name": self.model_name, "version": __version__}
        values.update({key: str(value) for key, value in labels.items()})
        self._info.info(values)


def _check_counts(*counts: int) -> None:
    for count in counts:
        if count < 0:
            raise ValueError(f"counts must be >= 0, got {counts}")
