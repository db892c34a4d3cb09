"""`metrale bench` beyond one fixed run: cached tokens and the warm-cache warning, fresh seeds, the
prefix_repetition and custom datasets, ramp-up arrivals, duration-bounded runs and two-server comparisons."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from metrale.bench.arrivals import ramp_offsets
from metrale.bench.loadgen import BenchSettings, run_benchmark, run_requests
from metrale.bench.report import format_comparison
from metrale.bench.targets import OpenAITarget
from metrale.bench.workloads import BenchRequest, load_custom, prefix_repetition_requests, random_requests
from tests.bench.test_loadgen import FakeTarget, sse


async def test_cached_tokens_are_summed_with_the_hit_rate():
    usage = {"prompt_tokens": 8, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 6}}
    body = sse(json.dumps({"choices": [{"text": "a"}]}), json.dumps({"choices": [], "usage": usage}), "[DONE]")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    async with OpenAITarget("http://127.0.0.1:9", model="m", transport=transport) as target:
        result = await run_benchmark(target, [BenchRequest(prompt_len=3, output_len=1, prompt="hi")] * 2,
                                     show_progress=False)
    assert result["total_cached_tokens"] == 12 and result["prefix_cache_hit_rate"] == pytest.approx(0.75)


def test_prefix_repetition_shares_a_few_prefixes():
    requests = prefix_repetition_requests(8, prefix_len=20, suffix_len=5, num_prefixes=2, output_len=3, seed=1)
    prefixes = {" ".join(r.prompt.split()[:20]) for r in requests}
    suffixes = {" ".join(r.prompt.split()[20:]) for r in requests}
    assert len(prefixes) == 2 and len(suffixes) == 8 and all(r.output_len == 3 for r in requests)
    assert requests == prefix_repetition_requests(8, 20, 5, 2, 3, seed=1)


def test_custom_jsonl_cycles_and_takes_output_tokens(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one two", "output_tokens": 7}\n\n{"prompt": "three"}\n')
    requests = load_custom(path, 5, output_len=4, seed=0)
    assert len(requests) == 5 and {(r.prompt, r.output_len) for r in requests} == {("one two", 7), ("three", 4)}
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        load_custom(path, 1, output_len=4)


@pytest.mark.parametrize("strategy", ["linear", "exponential"])
def test_ramp_up_gaps_shrink_as_the_rate_grows(strategy):
    offsets = ramp_offsets(4000, 1.0, 16.0, strategy, seed=2)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    assert gaps[:400].mean() > 4 * gaps[-400:].mean()  # ~1 s apart at the start, ~1/16 s at the end
    with pytest.raises(ValueError):
        ramp_offsets(3, 0.0, 1.0)


async def test_a_duration_bounded_run_sends_nothing_scheduled_after_its_end():
    target = FakeTarget()
    settings = BenchSettings(request_rate=1.0, burstiness=1000.0, duration_s=1.5)  # ~1 s apart: 0, 1 fit
    records, _ = await run_requests(target, random_requests(10, 4, 2, vocab_size=1000), settings)
    assert 1 <= len(records) <= 2 and len(target.sent_at) == len(records) and all(r.ok for r in records)


def test_a_comparison_table_has_the_ratios():
    a = {"label": "x", "output_throughput": 100.0, "median_ttft_ms": 50.0, "median_tpot_ms": 10.0}
    b = {"label": "x", "output_throughput": 150.0, "median_ttft_ms": 25.0, "median_tpot_ms": 10.0}
    table = format_comparison([(a, b)], ("http://a", "http://b"))
    assert "A = http://a" in table and "1.50" in table and "0.50" in table and "1.00" in table


@pytest.mark.real_model
@pytest.mark.timeout(240)
def test_fresh_seeds_meet_a_cold_cache_and_a_repeated_seed_is_flagged(tmp_path, capsys):
    from metrale.cli import main
    from tests.server.serve import SMALL, ServerProcess

    common = ["--num-prompts", "2", "--random-input-len", "64", "--random-output-len", "2", "--num-warmups", "0",
              "--no-progress", "--result-dir", str(tmp_path), "--no-plots"]
    with ServerProcess(*SMALL) as server:
        runs = [("fresh1.json", []), ("fresh2.json", []), ("seeded1.json", ["--seed", "5"]),
                ("seeded2.json", ["--seed", "5"])]
        for name, extra in runs:
            assert main(["bench", "--base-url", server.url(), *common, "--result-filename", name, *extra]) == 0
        compared = main(["bench", "--compare", server.url(), server.url(), *common, "--result-filename", "cmp.json"])
    out = capsys.readouterr()
    hit = {name: json.loads((tmp_path / name).read_text())["prefix_cache_hit_rate"] for name, _ in runs}
    assert hit["fresh2.json"] < 0.1 and hit["seeded2.json"] > 0.5, hit
    assert out.err.count("came from the server's prefix cache") >= 1
    assert compared == 0 and "B/A" in out.out and len(json.loads((tmp_path / "cmp.json").read_text())["runs"]) == 2
