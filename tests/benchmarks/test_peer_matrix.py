"""benchmarks/peer_matrix.py: the table, advantages and issue 23's targets on made-up runs; the run-time
and KV arithmetic on the 1B / 3B shapes; the matrix on the tiniest settings against `metrale serve` (and
llama-server when a binary is there: $METRALE_LLAMA_SERVER)."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def peer_matrix(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run as a script: `peers` is a sibling package
    return importlib.import_module("peer_matrix")


def made_up_run(model, engine, streams, tok_s, ttft_s, *, prompt_len=512, output_len=64):
    return {"model": model, "engine": engine, "streams": streams, "prompt_len": prompt_len, "output_len": output_len,
            "output_throughput": tok_s, "median_ttft_ms": ttft_s * 1e3, "total_input_tokens": streams * prompt_len,
            "details": {"ttfts": [ttft_s] * (streams - 1) + [2 * ttft_s]}, "token_counts_ok": True,
            "cpu": {"other": 0.01}}


def rss_record(peak_gib, steady_gib, prompt_len=4096):
    return {"prompt_len": prompt_len, "peak_hwm_bytes": int(peak_gib * 2**30),
            "steady_rss_bytes": int(steady_gib * 2**30), "ok": True}


def test_advantages_targets_and_the_table(peer_matrix):
    from peers import matrix_report

    runs = [made_up_run("llama-1b", "metrale", 1, 12.0, 2.0), made_up_run("llama-1b", "llama.cpp", 1, 10.0, 3.0),
            made_up_run("llama-1b", "metrale", 8, 30.0, 9.0), made_up_run("llama-1b", "llama.cpp", 8, 25.0, 9.0),
            made_up_run("135m", "metrale", 1, 60.0, 1.0, prompt_len=2048)]
    rss = {"llama-3b": {"metrale": rss_record(2.5, 2.0), "llama.cpp": rss_record(2.4, 2.4)}}
    document = matrix_report.result_document(runs, rss, {"llama-1b": {"metrale": {"transport": "HTTP"}}},
                                             {"rounds": 1}, {"total_s": 12.0, "estimate_s": 10})
    assert [r["model"] for r in document["rows"]] == ["llama-1b"] * 6 + ["135m"] * 3 + ["llama-3b"] * 2
    rows = {(r["model"], r.get("streams"), r["measure"]): r for r in document["rows"]}
    assert rows[("llama-1b", 1, "output_tok_s")]["advantage"] == pytest.approx(1.2)
    assert rows[("llama-1b", 1, "ttft_p50_s")]["advantage"] == pytest.approx(1.5)  # llama.cpp / metrale
    assert rows[("llama-1b", 8, "prompt_tok_s")]["values"]["metrale"] == pytest.approx(8 * 512 / 18.0)
    assert rows[("llama-3b", 1, "peak_rss_gib")]["advantage"] == pytest.approx(2.4 / 2.5)
    assert rows[("135m", 1, "ttft_p50_s")]["advantage"] is None  # no llama.cpp run

    targets = {t["label"]: t for t in document["targets"]}
    prompt = targets["1B: prompt processing (TTFT p50 at a 512-token prompt, 1 stream) >= 1.2x"]
    assert prompt["met"] is True and prompt["by"] == pytest.approx(1.5 / 1.2 - 1)
    eight = targets["1B: output tok/s >= 1.5x at 8 streams"]
    assert eight["met"] is False and eight["worst_advantage"] == pytest.approx(1.2) and eight["cells"] == 1
    assert targets["3B: peak RSS, model + a 4k-token context, below llama.cpp's"]["met"] is False
    assert targets["135M: TTFT p50 at a 2048-token prompt (1 stream) <= llama.cpp's"]["met"] is None
    assert targets["1B: output tok/s >= 2.0x at 32 streams"]["cells"] == 0

    table = matrix_report.markdown(document)
    assert "| llama-1b | 512 + 64, 8 streams | output tok/s | 30.0 | 25.0 | 1.20x | >= 1.5x: missed |" in table
    assert ("| llama-3b | one 4096-token prompt | peak RSS (GiB, sum of VmHWM) | 2.50 | 2.40 | 0.96x | "
            "> 1.0x: missed |") in table
    assert "- 1B: output tok/s >= 1.5x at 8 streams: MISSED (1.20x, -20% against the target, 1 cell)" in table
    assert "- 3B: output tok/s >= 1.0x at 1 stream: not measured" in table
    assert "| 135m | 2048 + 64, 1 stream | TTFT p50 (s) | 1.00 | - | - | >= 1.0x: not measured |" in table


def test_run_time_and_kv_arithmetic_on_the_shapes(peer_matrix):
    from peers import estimate

    import gguf_shapes_bench as shapes

    three, one = shapes.expected_shape("llama-3b"), shapes.expected_shape("llama-1b")
    assert estimate.parameters(three) == pytest.approx(3.21e9, rel=0.01)  # Llama-3.2-3B: 3.21 B
    assert estimate.parameters(one) == pytest.approx(1.24e9, rel=0.01)  # Llama-3.2-1B: 1.24 B
    assert estimate.kv_bytes_per_token(three) == 28 * 2 * 8 * 128 * 2
    # 2 sequences of 100 tokens: 7 blocks of 16 + 1 of slack each = 256 tokens of 32 KiB = 8 MiB
    assert estimate.kv_cache_mib(one, 2, 100) == 8
    base = ["--models", "llama-1b", "llama-3b", "--prompt-lens", "128", "--output-lens", "64",
            "--shapes-dir", "/nonexistent", "--rss-prompt-len", "0"]
    planned = peer_matrix.estimate_run(peer_matrix.parse_args([*base, "--streams", "1"]))
    assert 0 < planned["per_model_s"]["llama-1b"] < planned["per_model_s"]["llama-3b"]
    # one slot of 512 tokens (the smallest llama-server slot) of 112 KiB
    assert planned["memory"]["llama-3b"]["kv_per_server_gib"] == pytest.approx(512 * 114688 / 2**30, abs=0.01)
    bigger = peer_matrix.estimate_run(peer_matrix.parse_args([*base, "--streams", "1", "8"]))
    assert bigger["total_s"] > planned["total_s"]


def test_arguments(peer_matrix):
    defaults = peer_matrix.parse_args([])
    assert (defaults.models, defaults.prompt_lens, defaults.output_lens, defaults.streams) == (
        ["135m", "llama-1b", "llama-3b"], [128, 512, 2048], [64, 128], [1, 8, 32])
    assert defaults.engines == ["metrale", "llama.cpp"] and defaults.rss_prompt_len == 4096
    assert not defaults.metrale_in_process
    cells = peer_matrix.cells(peer_matrix.parse_args(["--prompt-lens", "8", "16", "--streams", "1", "2",
                                                      "--output-lens", "4"]))
    assert [(c.prompt_len, c.streams) for c in cells] == [(8, 1), (8, 2), (16, 1), (16, 2)]
    with pytest.raises(SystemExit):
        peer_matrix.parse_args(["--streams", "0"])


@pytest.mark.real_model
@pytest.mark.timeout(300)  # `metrale serve` starts twice (the cells, the RSS part): ~15 s each on a quiet machine
def test_the_matrix_on_the_tiniest_settings(peer_matrix, tmp_path):
    from peers import servers

    engines = ["metrale"]
    if os.environ.get(servers.ENV_BINARY):  # llama.cpp is not in CI: its part runs only where a binary is named
        engines.append("llama.cpp")
    code = peer_matrix.main(["--models", "135m", "--engines", *engines, "--prompt-lens", "8", "--output-lens", "4",
                             "--streams", "1", "2", "--rss-prompt-len", "64", "--rss-output-len", "2",
                             "--max-other-busy", "1.0", "--retries", "0", "--out-dir", str(tmp_path), "--name", "m"])
    assert code == 0
    document = json.loads((tmp_path / "m.json").read_text())
    assert [(r["engine"], r["streams"], r["total_output_tokens"]) for r in document["runs"]][:len(engines)] == [
        (e, 1, 4) for e in engines]
    assert len(document["runs"]) == 2 * len(engines) and all(r["token_counts_ok"] for r in document["runs"])
    cell_measures = ["output_tok_s", "ttft_p50_s", "prompt_tok_s"]
    assert [r["measure"] for r in document["rows"]] == [*cell_measures * 2, "peak_rss_gib", "steady_rss_gib"]
    rss = document["rss"]["135m"]["metrale"]
    assert rss["ok"] and rss["peak_hwm_bytes"] >= rss["steady_rss_bytes"] > 50 * 2**20  # the model is in memory
    assert len(rss["steady"]["processes"]) >= 2  # `metrale serve` and its engine process
    table = (tmp_path / "m.md").read_text()
    assert table.startswith("| model | workload (prompt + output) | measure | metrale | llama.cpp |")
    assert "| 135m | 8 + 4, 2 streams | output tok/s |" in table and "Targets (issue 23)" in table
    assert document["timing"]["total_s"] > 0 and document["timing"]["estimate_s"] > 0


def test_a_run_stopped_half_way_keeps_what_it_measured(peer_matrix, tmp_path):
    args = peer_matrix.parse_args(["--models", "llama-1b", "--out-dir", str(tmp_path), "--name", "p"])
    results = peer_matrix.Results(args, {"total_s": 5})
    results.add_run(made_up_run("llama-1b", "metrale", 1, 12.0, 2.0))
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["timing"]["complete"] is False and len(saved["runs"]) == 1
    results.add_rss("llama-1b", "metrale", rss_record(1.0, 0.9))
    assert json.loads((tmp_path / "p.json").read_text())["rss"]["llama-1b"]["metrale"]["ok"]
    assert "INCOMPLETE" in (tmp_path / "p.md").read_text()
    results.save(complete=True)
    assert "INCOMPLETE" not in (tmp_path / "p.md").read_text()
