"""The load generator: arrivals, metrics math, workloads, ShareGPT parsing, SSE parsing, the
mlx-lm driver on a tiny model, and short real runs in process and against `metrale serve`."""

from __future__ import annotations

import asyncio
import json
import math
import statistics

import httpx
import numpy as np
import pytest

from metrale.bench.arrivals import arrival_offsets
from metrale.bench.loadgen import BenchSettings, run_benchmark, run_requests
from metrale.bench.stats import GoodputSLOs, RequestRecord, summarize
from metrale.bench.targets import Chunk, OpenAITarget, TargetError, parse_event
from metrale.bench.workloads import (TOKEN_ID_LOW, BenchRequest, chat_requests, load_sharegpt,
                                     random_requests)

# ---- arrivals ----


def test_rate_inf_sends_everything_at_once():
    assert arrival_offsets(5) == [0.0] * 5


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_gamma_arrivals_have_the_rate_on_average_and_the_burstiness(burstiness, cv):
    offsets = arrival_offsets(20_000, request_rate=4.0, burstiness=burstiness, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.04)  # 1 / rate whatever the burstiness
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)  # gamma: CV = 1 / sqrt(shape)


def test_arrivals_are_seeded():
    assert arrival_offsets(50, 2.0, seed=1) == arrival_offsets(50, 2.0, seed=1)
    assert arrival_offsets(50, 2.0, seed=1) != arrival_offsets(50, 2.0, seed=2)


@pytest.mark.parametrize("kwargs", [{"request_rate": 0.0}, {"request_rate": -1.0}, {"burstiness": 0.0},
                                    {"burstiness": math.inf}, {"num_requests": -1}])
def test_bad_arrival_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        arrival_offsets(**{"num_requests": 3, **kwargs})


# ---- metrics math ----


def record(start, chunks, tokens=None, error=None, cancelled=False, prompt_len=10):
    return RequestRecord(prompt_len=prompt_len, start=start, end=chunks[-1] if chunks else start + 1,
                         chunk_times=list(chunks), output_tokens=len(chunks) if tokens is None else tokens,
                         error=error, cancelled=cancelled)


def test_latency_metrics_on_made_up_timestamps():
    records = [record(0.0, [0.5, 0.6, 0.8]),            # ttft 500, itl 100 200, tpot 150, e2el 800
               record(1.0, [1.2, 1.3, 1.4, 1.5, 1.6]),  # ttft 200, itl 100 x4, tpot 100, e2el 600
               record(0.0, [0.1], error="TargetError: error event mid-stream: boom"),
               record(0.0, [0.1, 0.2], cancelled=True)]
    m = summarize(records, duration_s=2.0)
    assert (m["completed"], m["failed"], m["cancelled"]) == (2, 1, 1)
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 4.0 and m["total_token_throughput"] == 14.0
    assert m["mean_ttft_ms"] == pytest.approx(350) and m["median_ttft_ms"] == pytest.approx(350)
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.99 * 300)  # linear interpolation, as numpy/vLLM
    assert m["std_ttft_ms"] == pytest.approx(150)
    assert m["mean_tpot_ms"] == pytest.approx(125)
    itls = [100, 200, 100, 100, 100, 100]
    assert m["mean_itl_ms"] == pytest.approx(statistics.mean(itls))
    assert m["p99_itl_ms"] == pytest.approx(np.percentile(itls, 99))
    assert m["median_e2el_ms"] == pytest.approx(700)


def test_one_token_requests_have_no_tpot_and_empty_metrics_are_zero():
    m = summarize([record(0.0, [0.3])], duration_s=1.0)
    assert m["mean_ttft_ms"] == pytest.approx(300) and m["mean_tpot_ms"] == 0.0 and m["mean_itl_ms"] == 0.0
    assert summarize([record(0.0, [0.1], error="x")], 1.0)["completed"] == 0


# ---- goodput (vLLM's --goodput) ----


def goodput_records():
    """TTFT / TPOT / E2EL in ms of each completed request in the comments."""
    return [record(0.0, [0.2, 0.3, 0.4]),                 # 200 / 100 / 400
            record(0.0, [0.6, 0.65, 0.7, 0.75, 0.8]),     # 600 /  50 / 800
            record(0.0, [0.1, 0.5]),                      # 100 / 400 / 500
            record(0.0, [0.3]),                           # 300 / one token: TPOT 0 / 300
            record(0.0, [0.05], error="TargetError: boom"),   # failed: never good, still sent
            record(0.0, [0.05, 0.1], cancelled=True)]     # cancelled on purpose: not counted at all


@pytest.mark.parametrize("slos, good", [
    (GoodputSLOs(ttft_ms=300), 3),                 # 200, 100, 300 (an SLO is met at equality)
    (GoodputSLOs(tpot_ms=100), 3),                 # 100, 50, 0
    (GoodputSLOs(e2el_ms=500), 3),                 # 400, 500, 300
    (GoodputSLOs(ttft_ms=300, tpot_ms=100), 2),    # the first and the one-token request
    (GoodputSLOs(ttft_ms=300, tpot_ms=100, e2el_ms=350), 1),
    (GoodputSLOs(ttft_ms=1e6, tpot_ms=1e6, e2el_ms=1e6), 4),  # every completed request, never the failed one
    (GoodputSLOs(ttft_ms=0), 0),
])
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    m = summarize(goodput_records(), duration_s=2.0, slos=slos)
    assert m["good_requests"] == good
    assert m["request_goodput"] == pytest.approx(good / 2.0)
    assert m["request_goodput_ratio"] == pytest.approx(good / 5)  # 4 completed + 1 failed were sent
    assert m["goodput_slos_ms"] == slos.as_dict()


def test_no_slos_no_goodput_fields():
    assert not any("goodput" in key for key in summarize(goodput_records(), duration_s=2.0))


def test_goodput_slos_parse_like_vllm():
    assert GoodputSLOs.parse(["ttft:500", "e2el:2000.5"]) == GoodputSLOs(ttft_ms=500, e2el_ms=2000.5)
    assert GoodputSLOs.parse(["tpot:0"]).as_dict() == {"tpot": 0.0}


@pytest.mark.parametrize("items, message", [
    (["itl:5"], "name one of ttft, tpot, e2el"), (["ttft"], "name:ms"), (["ttft:fast"], "not a number"),
    (["ttft:-1"], ">= 0"), (["tpot:nan"], ">= 0"), (["e2el:inf"], ">= 0"), (["ttft:1", "ttft:2"], "twice"),
    ([], "at least one SLO"),
])
def test_bad_goodput_slos_are_refused(items, message):
    with pytest.raises(ValueError, match=message):
        GoodputSLOs.parse(items)


async def test_goodput_in_a_run_and_in_the_report():
    from metrale.bench.report import format_result, format_sweep

    result = await run_benchmark(FakeTarget(), random_requests(4, 4, 3, vocab_size=1000), show_progress=False,
                                 slos=GoodputSLOs(ttft_ms=60_000, e2el_ms=60_000))
    assert (result["good_requests"], result["request_goodput_ratio"]) == (4, 1.0)
    assert result["request_goodput"] == pytest.approx(4 / result["duration"])
    table = format_result(result)
    assert "Request goodput (req/s):" in table and "4 (100%)" in table and "ttft:60000 e2el:60000" in table
    assert "good req/s" in format_sweep([result])


def test_bench_cli_refuses_a_bad_goodput_before_running(capsys):
    from metrale.cli import main

    assert main(["bench", "--goodput", "ttft:100", "latency:5", "--no-save"]) == 2
    assert "--goodput: bad goodput SLO 'latency:5'" in capsys.readouterr().err


class FakeTarget:
    """Yields `chunks` chunks 1 ms apart, then fails if `fail_after` is set; tracks concurrency."""

    name = "fake"

    def __init__(self, fail_after: int | None = None):
        self.fail_after = fail_after
        self.in_flight = self.max_in_flight = 0
        self.sent_at: list[float] = []

    async def stream(self, request):
        self.sent_at.append(asyncio.get_running_loop().time())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for i in range(request.output_len):
                await asyncio.sleep(0.001)
                if self.fail_after is not None and i == self.fail_after:
                    raise TargetError("error event mid-stream: engine failed")
                yield Chunk(1)
        finally:
            self.in_flight -= 1


async def test_a_mid_stream_error_counts_as_failed():
    requests = random_requests(3, 4, 5, vocab_size=1000)
    result = await run_benchmark(FakeTarget(fail_after=2), requests, show_progress=False)
    assert result["failed"] == 3 and result["completed"] == 0
    assert result["details"]["errors"][0] == "TargetError: error event mid-stream: engine failed"


async def test_max_concurrency_and_the_schedule_are_kept():
    target = FakeTarget()
    records, duration = await run_requests(target, random_requests(12, 4, 5, vocab_size=1000),
                                           BenchSettings(max_concurrency=3))
    assert target.max_in_flight == 3 and all(r.ok and r.output_tokens == 5 for r in records)
    target = FakeTarget()
    await run_requests(target, random_requests(4, 4, 2, vocab_size=1000), BenchSettings(request_rate=20.0, seed=5))
    sent = np.array(target.sent_at) - target.sent_at[0]
    assert np.allclose(sent, arrival_offsets(4, 20.0, seed=5), atol=0.02)


# ---- SSE parsing (OpenAITarget over a mock transport) ----


def sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


async def run_mock(body: bytes, status: int = 200) -> dict:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    async with OpenAITarget("http://127.0.0.1:9", model="m", transport=transport) as target:
        return await run_benchmark(target, [BenchRequest(prompt_len=3, output_len=4, prompt="hi")],
                                   show_progress=False)


async def test_sse_stream_counts_chunks_and_takes_usage():
    chunks = [json.dumps({"choices": [{"text": t, "finish_reason": None}]}) for t in ("a", "", "b", "c")]
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}})
    result = await run_mock(sse(*chunks, usage, "[DONE]"))
    assert result["completed"] == 1
    assert result["total_input_tokens"] == 7 and result["total_output_tokens"] == 4  # usage wins
    assert len(result["details"]["itls"][0]) == 2  # three chunks with text: two gaps


@pytest.mark.parametrize("body, status, message", [
    (sse(json.dumps({"choices": [{"text": "a"}]}), json.dumps({"error": {"message": "step failed"}}), "[DONE]"),
     200, "error event mid-stream: step failed"),
    (sse(json.dumps({"choices": [{"text": "a"}]})), 200, "without data: [DONE]"),
    (b'{"error": {"message": "queue full"}}', 429, "HTTP 429"),
])
async def test_sse_failures_count_as_failed(body, status, message):
    result = await run_mock(body, status)
    assert result["failed"] == 1 and message in result["details"]["errors"][0]


def test_chat_deltas_count_only_with_content():
    assert parse_event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) is None
    assert parse_event({"choices": [{"delta": {"content": "Hi"}}]}) == Chunk(1)


def test_an_event_with_text_and_usage_is_both_output_and_the_count():
    """llama-server's last event carries usage and, when it merged tokens under load, text as well."""
    event = {"choices": [{"text": " end", "finish_reason": "length"}],
             "usage": {"prompt_tokens": 128, "completion_tokens": 128}}
    assert parse_event(event) == Chunk(1, prompt_tokens=128, completion_tokens=128)
    assert parse_event({"choices": [{"text": "", "finish_reason": "length"}], "usage": event["usage"]}) == \
        Chunk(0, prompt_tokens=128, completion_tokens=128)


# ---- workloads ----


def test_random_token_workload_is_seeded_with_exact_lengths():
    a = random_requests(20, 16, 8, seed=4, range_ratio=0.5, vocab_size=500)
    assert a == random_requests(20, 16, 8, seed=4, range_ratio=0.5, vocab_size=500)
    assert all(len(r.prompt) == r.prompt_len and 8 <= r.prompt_len <= 24 and 4 <= r.output_len <= 12 for r in a)
    assert all(TOKEN_ID_LOW <= t < 500 for r in a for t in r.prompt)
    assert len({r.prompt_len for r in a}) > 3
    text = random_requests(3, 10, 5, seed=1)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 10 for r in text)


def test_chat_workload_shares_one_system_prompt():
    requests = chat_requests(5, system_len=50, user_len=8, output_len=4, seed=2)
    systems = {r.messages[0]["content"] for r in requests}
    users = {r.messages[1]["content"] for r in requests}
    assert len(systems) == 1 and len(next(iter(systems)).split()) == 50 and len(users) == 5


def test_sharegpt_parsing(tmp_path):
    long = "word " * 40
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": long}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long}]},  # short
        {"id": "c", "conversations": [{"from": "human", "value": long}]},  # one turn
        {"id": "d", "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": long}]},  # not text
        {"id": "e"},
        {"id": "f", "conversations": [{"from": "human", "value": long * 2}, {"from": "gpt", "value": "ok ok ok ok"},
                                      {"from": "human", "value": "more"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = load_sharegpt(path, 2, count_tokens=lambda text: len(text.split()))
    assert sorted((r.prompt_len, r.output_len) for r in requests) == [(40, 40), (80, 4)]
    assert all(r.prompt.startswith("word") for r in requests)
    assert {r.output_len for r in load_sharegpt(path, 2, output_len=9)} == {9}
    with pytest.raises(ValueError, match="only 2 of 3"):
        load_sharegpt(path, 3, count_tokens=lambda text: len(text.split()))
    path.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="JSON list"):
        load_sharegpt(path, 1)


# ---- the mlx-lm driver, on a tiny random llama ----


async def test_mlx_lm_target_streams_counts_and_cancels():
    from metrale.bench.mlx_lm_target import MlxLmTarget, mlx_lm_model
    from metrale.models.config import ModelConfig
    from tests.metrale.model_helpers import make_twins, tiny_config_dict

    config = tiny_config_dict()
    _, model = make_twins(config)
    async with MlxLmTarget(lambda: mlx_lm_model(ModelConfig.from_hf_dict(config), model)) as target:
        requests = random_requests(4, 6, 5, seed=1, vocab_size=config["vocab_size"])
        result = await run_benchmark(target, requests, BenchSettings(max_concurrency=4), show_progress=False)
        assert result["completed"] == 4 and result["total_output_tokens"] == 20
        record = RequestRecord(prompt_len=6)
        from metrale.bench.loadgen import measure
        await measure(target, BenchRequest(prompt_len=6, output_len=50, prompt=requests[0].prompt), record,
                      cancel_after_tokens=2)
        assert record.cancelled and record.output_tokens == 2
        again = await run_benchmark(target, requests[:1], show_progress=False)  # still serving after a removal
        assert again["completed"] == 1 and again["total_output_tokens"] == 5


# ---- real runs: the in-process engine, and `metrale serve` ----


@pytest.mark.real_model
@pytest.mark.timeout(90)
async def test_real_in_process_run_and_a_short_soak():
    from metrale import AsyncEngine, EngineConfig
    from metrale.bench.soak import SoakSettings, soak
    from metrale.bench.targets import EngineTarget

    config = EngineConfig(kv_cache_bytes=64 << 20, max_model_len=512, max_num_seqs=8)
    async with AsyncEngine(config) as engine:
        vocab = engine.vocab_size
        target = EngineTarget(engine)
        requests = random_requests(3, 12, 4, seed=0, vocab_size=vocab) + chat_requests(1, 20, 5, 4)
        result = await run_benchmark(target, requests, BenchSettings(max_concurrency=4), show_progress=False,
                                     warmups=random_requests(1, 4, 2, seed=9, vocab_size=vocab))
        assert (result["completed"], result["failed"], result["total_output_tokens"]) == (4, 0, 16)
        assert result["total_input_tokens"] > 36  # the chat request's count is the rendered template's
        assert result["mean_ttft_ms"] > 0 and result["p99_itl_ms"] > 0
        settings = SoakSettings(duration_s=1.0, cycle_s=1.0, idle_s=0.3, request_rate=6.0, input_len=8,
                                output_len=6, cancel_fraction=0.5, max_cancel_delay_s=0.3, sample_every_s=0.2)
        outcome = await soak(engine, settings)
        engine.check_integrity()
    assert outcome["verdict"] == "FAIL" and "only 1 idle checks" in outcome["reasons"][0]  # too short to judge RSS
    assert len(outcome["reasons"]) == 1 and outcome["idle_checks"][0]["ok"] and outcome["failed"] == 0
    assert outcome["cancelled"] >= 1 and outcome["requests"] == 6


@pytest.mark.real_model
@pytest.mark.timeout(120)
def test_metrale_bench_cli_against_metrale_serve(tmp_path, capsys):
    from metrale.cli import main
    from tests.server.serve import SMALL, ServerProcess

    with ServerProcess(*SMALL) as server:
        code = main(["bench", "--base-url", server.url(), "--num-prompts", "2", "--random-input-len", "8",
                     "--random-output-len", "4", "--max-concurrency", "2", "--num-warmups", "1", "--no-progress",
                     "--result-dir", str(tmp_path), "--result-filename", "run.json"])
        server.wait_for(lambda s: s.idle(), what="server idle after the bench")
    assert code == 0, capsys.readouterr().out
    result = json.loads((tmp_path / "run.json").read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (2, 0, 8)
    assert result["total_input_tokens"] >= 16 and result["backend"] == server.url()
    assert (tmp_path / "run.latency.png").stat().st_size > 10_000
    assert "Serving Benchmark Result" in capsys.readouterr().out
