"""benchmarks/compare_peers.py's plumbing without llama.cpp or long runs: fake engines through the
real loop, summary, table, JSON and plot; the ratio and target arithmetic on made-up runs."""

from __future__ import annotations

import asyncio
import importlib
import json
from pathlib import Path

import pytest

from metrale.bench.targets import Chunk

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
pytestmark = pytest.mark.timeout(60)  # fake engines, a few ms per request: seconds in all


@pytest.fixture
def compare_peers(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run as a script: `peers` is a sibling package
    module = importlib.import_module("compare_peers")

    async def quiet_at_once(watched, **kwargs):
        return {"quiet": True, "waited_s": 0.0, "other_busy_before": 0.0, "load_average_before": [0.5, 0.5, 0.5]}

    monkeypatch.setattr(module, "wait_for_quiet", quiet_at_once)  # the real one samples the CPU for 1 s a run
    monkeypatch.setattr(module, "load_average", lambda: [0.75, 0.5, 0.5])  # the table's range, not this machine's
    return module


class FakeEngine:
    """Streams the asked number of tokens (`short` fewer), reporting the prompt length; logs who ran what."""

    def __init__(self, name: str, log: list, short: int = 0):
        self.name, self.log, self.short = name, log, short

    async def stream(self, request):
        self.log.append((self.name, tuple(request.prompt)))
        for _ in range(request.output_len - self.short):
            await asyncio.sleep(0.01)  # a run spans several /proc/stat ticks (10 ms): cpu_usage needs time to pass
            yield Chunk(1, prompt_tokens=len(request.prompt))


async def test_fake_engines_through_the_loop_the_table_the_json_and_the_plot(compare_peers, tmp_path):
    from peers import report

    log: list = []
    names = ("metrale", "llama.cpp", "mlx-lm")
    peers = [compare_peers.Peer(n, FakeEngine(n, log), info={"transport": "fake"}) for n in names]
    plan = compare_peers.Plan(streams=(1, 8), rounds=2, prompt_len=5, output_len=3, vocab_size=1000, retries=0)
    runs = await compare_peers.compare(peers, plan)

    assert [(r["round"], r["streams"]) for r in runs] == [(1, 1)] * 3 + [(1, 8)] * 3 + [(2, 1)] * 3 + [(2, 8)] * 3
    assert [r["engine"] for r in runs[:6]] == ["metrale", "llama.cpp", "mlx-lm", "llama.cpp", "mlx-lm", "metrale"]
    assert all(r["token_counts_ok"] and r["completed"] == r["streams"] for r in runs)
    assert all(r["total_output_tokens"] == 3 * r["streams"] and r["max_concurrency"] == r["streams"] for r in runs)
    measured = log[12:]  # after 4 warm-up requests per engine
    assert len(measured) == 2 * (1 + 8) * 3 and {len(p) for _, p in measured} == {5}
    level = [p for _, p in measured[:3]]
    assert level[0] == level[1] == level[2]  # the engines of a level get the same prompts
    assert {"machine", "client", "other", "steal", "top_other"} <= runs[0]["cpu"].keys()

    document = report.result_document(runs, {p.name: p.info for p in peers}, vars(compare_peers.parse_args([])))
    levels = document["summary"]["levels"]
    assert [lv["streams"] for lv in levels] == [1, 8]
    assert levels[1]["ratios"]["llama.cpp"]["target"] == 1.3 and levels[1]["ratios"]["mlx-lm"]["target"] == 2.0
    table = report.markdown(document)
    assert ("| streams | metrale tok/s | llama.cpp tok/s | mlx-lm tok/s | metrale / llama.cpp | metrale / mlx-lm"
            in table)
    assert "(>= 1.3x: " in table and "load average 0.50-0.75 before/after" in table

    paths = report.save(document, tmp_path, "peers")
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert len(saved["runs"]) == 12 and "itls" not in saved["runs"][0]["details"]
    assert saved["summary"]["token_counts_ok"] is True and saved["args"]["streams"] == [1, 8, 32]
    assert (tmp_path / "peers.md").read_text() == table and (tmp_path / "peers.png").stat().st_size > 10_000
    assert len(paths) == 3


async def test_wrong_token_counts_are_flagged(compare_peers):
    from peers import report

    peers = [compare_peers.Peer("metrale", FakeEngine("metrale", [])),
             compare_peers.Peer("llama.cpp", FakeEngine("llama.cpp", [], short=1))]
    runs = await compare_peers.compare(peers, compare_peers.Plan(streams=(2,), rounds=1, prompt_len=4, output_len=3,
                                                                 vocab_size=1000, retries=0))
    assert [r["token_counts_ok"] for r in runs] == [True, False]
    assert report.summary(runs)["token_counts_ok"] is False


async def test_a_disturbed_run_is_repeated_with_new_prompts(compare_peers, monkeypatch):
    others = iter([0.6, 0.4, 0.05])  # the first two attempts were disturbed, the third was not

    def cpu_usage(before, after, watched):
        return {"machine": 1.0, "client": 0.0, "other": next(others), "steal": 0.0, "top_other": []}

    monkeypatch.setattr(compare_peers, "cpu_usage", cpu_usage)
    log: list = []
    plan = compare_peers.Plan(streams=(1,), rounds=1, prompt_len=4, output_len=2, vocab_size=1000, retries=2)
    [run] = await compare_peers.compare([compare_peers.Peer("metrale", FakeEngine("metrale", log))], plan)
    assert [a["cpu"]["other"] for a in run["disturbed_attempts"]] == [0.6, 0.4] and run["cpu"]["other"] == 0.05
    prompts = [p for _, p in log[4:]]
    assert len(prompts) == 3 and len(set(prompts)) == 3  # no prefix cache can help a repeat

    others = iter([0.9, 0.9])  # what the patched cpu_usage reads now
    [run] = await compare_peers.compare([compare_peers.Peer("metrale", FakeEngine("metrale", []))],
                                        compare_peers.Plan(streams=(1,), rounds=1, prompt_len=4, output_len=2,
                                                           vocab_size=1000, retries=1))
    assert len(run["disturbed_attempts"]) == 1 and run["cpu"]["other"] == 0.9  # out of retries: kept, recorded


def made_up_run(engine, streams, tok_s, ttft_ms=100.0):
    return {"engine": engine, "streams": streams, "output_throughput": tok_s, "mean_ttft_ms": ttft_ms}


def test_ratios_medians_and_targets(compare_peers):
    from peers import report

    runs = [made_up_run("metrale", 8, 100.0), made_up_run("metrale", 8, 140.0), made_up_run("metrale", 8, 120.0),
            made_up_run("llama.cpp", 8, 100.0), made_up_run("llama.cpp", 8, 90.0), made_up_run("llama.cpp", 8, 95.0),
            made_up_run("mlx-lm", 8, 60.0), made_up_run("mlx-lm", 8, 59.0, ttft_ms=300.0)]
    level = report.level_summary(runs, 8, ["metrale", "llama.cpp", "mlx-lm"])
    assert level["output_throughput"] == {"metrale": 120.0, "llama.cpp": 95.0, "mlx-lm": 59.5}
    assert level["mean_ttft_ms"]["mlx-lm"] == 200.0
    assert level["ratios"]["llama.cpp"] == {"ratio": pytest.approx(120 / 95), "target": 1.3, "met": False}
    assert level["ratios"]["mlx-lm"] == {"ratio": pytest.approx(120 / 59.5), "target": 2.0, "met": True}
    assert report.target_ratio("llama.cpp", 1) == 1.0 and report.target_ratio("llama.cpp", 32) == 1.8
    assert report.target_ratio("llama.cpp", 16) is None and report.target_ratio("mlx-lm", 16) == 2.0
    no_metrale = report.level_summary(runs, 8, ["llama.cpp", "mlx-lm"])
    assert no_metrale["ratios"] == {}


def test_arguments_and_plan_checks(compare_peers):
    args = compare_peers.parse_args(["--streams", "1", "4", "--rounds", "3", "--llama-server", "/x/llama-server",
                                     "--engines", "metrale", "llama.cpp"])
    assert (args.streams, args.rounds, args.llama_server, args.engines) == ([1, 4], 3, "/x/llama-server",
                                                                           ["metrale", "llama.cpp"])
    defaults = compare_peers.parse_args([])
    assert (defaults.streams, defaults.prompt_len, defaults.output_len) == ([1, 8, 32], 128, 128)
    assert defaults.out_dir == "benchmarks/results" and not defaults.metrale_in_process
    with pytest.raises(ValueError, match="streams >= 1"):
        compare_peers.Plan(streams=(0,), rounds=1, prompt_len=1, output_len=1, vocab_size=10)


@pytest.mark.real_model
@pytest.mark.timeout(180)  # two model loads and a 1 GiB KV pool: ~15 s on a quiet machine
def test_main_end_to_end_with_metrale_in_process_and_mlx_lm(compare_peers, tmp_path):
    """The real open_peers/run/save path on the default model, 2 short requests (no llama.cpp)."""
    code = compare_peers.main(["--engines", "metrale", "mlx-lm", "--metrale-in-process", "--streams", "2",
                               "--rounds", "1", "--prompt-len", "8", "--output-len", "4", "--out-dir", str(tmp_path),
                               "--name", "e2e"])
    assert code == 0
    document = json.loads((tmp_path / "e2e.json").read_text())
    assert [(r["engine"], r["streams"], r["total_output_tokens"], r["total_input_tokens"]) for r in document["runs"]] \
        == [("metrale", 2, 8, 16), ("mlx-lm", 2, 8, 16)]
    assert document["engines"]["metrale"]["transport"] == "in process (AsyncEngine)"
    assert set(document["summary"]["levels"][0]["ratios"]) == {"mlx-lm"}
