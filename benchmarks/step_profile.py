"""Where one decode step's time goes, measured in one run (so ratios hold on a noisy machine).

    .venv/bin/python benchmarks/step_profile.py --batch 1 --context 256            # default: quantized kernels
    .venv/bin/python benchmarks/step_profile.py --batch 32 --context 256 --dtype float32
    .venv/bin/python benchmarks/step_profile.py --model /tmp/metrale-shapes/llama-1b-q4_0.gguf --batch 1
                                                (a file from benchmarks/gguf_shapes_bench.py --write-only)
    .venv/bin/python benchmarks/step_profile.py --model FILE --batch 1 --chunk 512 --context 0   # a prompt chunk

Times, for the default model (or --model), one step of `--batch` sequences with `--context` tokens cached
and `--chunk` new tokens each (1: a decode step; more: a prompt chunk, sampled at its last row), best of
--repeat:
  step_ms        the full runner step (ModelRunner.execute)
  host_ms        the runner's host work before the model: step metadata and the token array
  graph_ms       building the step's lazy graph: the model's Python forward and compute_logits (a decode
                 step hands each layer to MLX as it is built, llama.OVERLAP_LAYERS: its kernels start here)
  eval_ms        mx.eval of the logits and the K/V writes (MLX dispatch + every kernel not yet run)
  sample_ms      sampler.prepare + sampler.sample (greedy: argmax and one .tolist())
  matmul_ms      the model's weight matmuls alone for the same rows (the kernels' modules, or the
                 float32 weights; the lm_head on the sampled rows only), as one evaluation: the
                 matmul-only bound
  matmul_gflops  their arithmetic (2 x rows x weights, int or float) over matmul_ms, and step_gflops
                 the same arithmetic over step_ms
  attention_ms   paged attention alone for all layers (the decode kernel, or the prefill one for chunks)
  graph_nodes    arrays in the evaluated graph (mx.export_to_dot), a proxy for MLX's per-op cost
  node_kinds     the evaluated graph's primitives by name and count
  ops_ms         the step's other op kinds alone, each as many calls as one step makes, on the step's
                 shapes, each kind as one evaluation (its MLX dispatch included): rms_norm (2 per
                 layer + 1), residual add (2 per layer), rope (tables once + 1 rotation per layer),
                 kv_write (K and V per layer, cast to the pool dtype included), logits_rows (the
                 gather of the sampled rows), argmax (the sampler's, on (batch, vocab) float32)
  other_ms       step_ms - matmul_ms - attention_ms - sum(ops_ms): what no part above explains
                 (MLX's scheduling between nodes, the cache misses a node meets in the real graph).
                 rms_norm and residual_add are timed apart, while the step fuses each add into the
                 next norm (AddRmsNormCPU): on a prompt chunk they count twice and this goes negative
  weight_gbs_*   the packed weight bytes (weight_mib) over step_ms and over matmul_ms: the decode's read rate
With --read-roof, after the timings: --read-roof-rounds rounds of the machine's read bandwidth
(benchmarks/roofline_probe.c, same thread count, --read-roof-mib of buffer (1 GiB), the wall rate on 4 KiB and on
huge pages), each followed by the step and the matmuls again (best of --repeat), so that each share compares
minutes of the same bandwidth (a shared VM's moves 2x between minutes); per round, weight_gbs_* over the higher
of the probe's two rates: read_roof_rounds, and their medians read_gbs, read_huge_gbs, weight_read_share_step /
_matmul: the issue's "decode reads the weights at >= 85% of the measured read bandwidth".
  --pages mlx    the packed weights left on MLX's 4 KiB pages (default: huge pages, as the loader does)
  --ab           instead: step_ms with this branch's decode fusions on / off, alternated (best, median)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from kernels import ext, qmm  # noqa: E402
from kernels.sampling import argmax_fn  # noqa: E402
from kernels.norm_rope import RMSNorm  # noqa: E402
from kernels.backend import attention_backend, select_backends  # noqa: E402
from kernels.qmm import QuantizedEmbeddingCPU, QuantizedLinearCPU  # noqa: E402
from kvcache.attention import AttentionMetadata, paged_attention  # noqa: E402
from metrale.config import EngineConfig  # noqa: E402
from metrale.engine.runner import ModelRunner, SamplingRow, StepInput  # noqa: E402
from metrale.models import llama  # noqa: E402
from metrale.sampling.sampler import Sampler  # noqa: E402
from metrale.sampling_params import SamplingParams  # noqa: E402
from scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def block_tables(runner: ModelRunner, batch: int, context: int, chunk: int) -> list[tuple[int, ...]]:
    blocks = -(-(context + chunk) // runner.kv_cache.block_size)
    return [tuple(range(s * blocks, (s + 1) * blocks)) for s in range(batch)]


def profiled_step(runner: ModelRunner, batch: int, context: int, chunk: int) -> StepInput:
    """`batch` sequences, each `chunk` new tokens after `context` cached ones, each sampled at its last row."""
    tables = block_tables(runner, batch, context, chunk)
    vocab = runner.model_config.vocab_size
    scheduled = tuple(ScheduledRequest(f"r{s}", tuple((100 + s + i) % vocab for i in range(chunk)), context, tables[s],
                                       True) for s in range(batch))
    out = SchedulerOutput(scheduled, batch * chunk, (), runner.kv_cache.block_size)
    params = SamplingParams(temperature=0, max_tokens=1)
    rows = tuple(SamplingRow(f"r{s}", params, (1,) * (context + chunk), ()) for s in range(batch))
    return StepInput(out, rows)


def sampled_rows(step: StepInput) -> list[int]:
    """The flat-batch row each sequence samples from: the last of its chunk."""
    rows, end = [], 0
    for s in step.scheduler_output.scheduled:
        end += len(s.token_ids)
        rows.append(end - 1)
    return rows


def step_inputs(runner: ModelRunner, step: StepInput) -> tuple[mx.array, AttentionMetadata]:
    """The runner's host work before the model: the flat token array and the step's attention metadata."""
    scheduled = step.scheduler_output.scheduled
    metadata = AttentionMetadata.build([len(s.token_ids) for s in scheduled],
                                       [s.start_position + len(s.token_ids) for s in scheduled],
                                       [s.block_table for s in scheduled], runner.kv_cache.block_size)
    return mx.array([t for s in scheduled for t in s.token_ids], dtype=mx.int32), metadata


def step_logits(runner: ModelRunner, step: StepInput, token_ids: mx.array, metadata: AttentionMetadata) -> mx.array:
    """The step's lazy graph: the forward and the logits of the sampled rows."""
    hidden = runner.model(token_ids, metadata.positions, runner.kv_cache, metadata)
    return runner.model.compute_logits(hidden[mx.array(sampled_rows(step), dtype=mx.int32)])


def phases(runner: ModelRunner, step: StepInput, repeats: int) -> dict[str, float]:
    """The runner's step split in host / graph / eval / sample (mirrors ModelRunner.execute)."""
    best: dict[str, float] = {}
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        token_ids, metadata = step_inputs(runner, step)
        t1 = time.perf_counter()
        logits = step_logits(runner, step, token_ids, metadata)
        t2 = time.perf_counter()
        mx.eval(logits, runner._pools())
        t3 = time.perf_counter()
        runner.sampler.sample(logits, runner.sampler.prepare(step.sampling_rows))
        t4 = time.perf_counter()
        for name, value in (("host_ms", t1 - t0), ("graph_ms", t2 - t1), ("eval_ms", t3 - t2), ("sample_ms", t4 - t3)):
            best[name] = min(best.get(name, 1e9), value * 1e3)
    return best


def graph_nodes(runner: ModelRunner, step: StepInput) -> tuple[int, dict[str, int]]:
    """The step's whole lazy graph: built without handing each layer to MLX as it goes (llama.OVERLAP_LAYERS)."""
    overlap, llama.OVERLAP_LAYERS = llama.OVERLAP_LAYERS, False
    try:
        logits = step_logits(runner, step, *step_inputs(runner, step))
    finally:
        llama.OVERLAP_LAYERS = overlap
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step.dot")
        mx.export_to_dot(path, logits, *runner._pools())
        text = open(path).read()
    mx.eval(logits, runner._pools())
    kinds: dict[str, int] = {}
    for label in re.findall(r'^\s*\{?\s*\S+ \[label\s*=\s*"([^"\s]*)', text, flags=re.M):
        kinds[label] = kinds.get(label, 0) + 1
    return sum(kinds.values()), dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def step_metadata(runner: ModelRunner, batch: int, context: int, chunk: int) -> AttentionMetadata:
    return AttentionMetadata.build([chunk] * batch, [context + chunk] * batch,
                                   block_tables(runner, batch, context, chunk), runner.kv_cache.block_size)


def op_costs(runner: ModelRunner, batch: int, context: int, chunk: int, repeats: int) -> dict[str, float]:
    """ms per step of each non-matmul, non-attention op kind of a llama-family step (see the module
    docstring), each kind with as many calls as one step has, evaluated as one graph."""
    model = runner.model.model
    mc = runner.model_config
    layers = mc.num_hidden_layers
    dim, vocab = mc.hidden_size, mc.vocab_size
    tokens = batch * chunk
    x = mx.random.normal((tokens, dim))
    q = mx.random.normal((tokens, mc.num_attention_heads, mc.head_dim))
    k = mx.random.normal((tokens, mc.num_key_value_heads, mc.head_dim))
    hidden = mx.random.normal((tokens, dim))
    logits = mx.random.normal((batch, vocab))
    mx.eval(x, q, k, hidden, logits)
    norm = model.layers[0].input_layernorm
    attn = model.layers[0].self_attn
    argmax = argmax_fn(runner.backends.activations)

    def calls(op, count):  # independent calls on one input: a chain of norms would run into denormals
        return lambda: mx.eval([op(x) for _ in range(count)])

    def rope():
        md = step_metadata(runner, batch, context, chunk)  # the tables are built once per step
        mx.eval([attn._rope.rotate_qk(q, k, md.positions, md) for _ in range(layers)])

    def kv_write():
        md = step_metadata(runner, batch, context, chunk)
        mx.eval([runner.kv_cache.write(i, k, k, md.slot_mapping) for i in range(layers)])

    rows = [(s + 1) * chunk - 1 for s in range(batch)]
    timed = {"rms_norm": calls(norm, 2 * layers + 1), "residual_add": calls(lambda y: y + hidden, 2 * layers),
             "rope": rope, "kv_write": kv_write,
             "logits_rows": lambda: mx.eval(hidden[mx.array(rows, dtype=mx.int32)]),
             "argmax": lambda: mx.eval(argmax(logits))}
    return {name: round(best_of(fn, repeats) * 1e3, 2) for name, fn in timed.items()}


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of the packed weights one step's matmuls stream, the lm_head included: q + scales, + biases
    unless the kernels compute them from the scales (symmetric Q4_0 / Q8_0: bias_per_scale)."""
    return sum(a.nbytes for _, m in runner.model.named_modules()
               if isinstance(m, (QuantizedLinearCPU, QuantizedEmbeddingCPU))
               for a in (m.q, m.scales, *([] if m.bias_per_scale else [m.biases])))


def is_head(name: str) -> bool:
    """The module or weight that computes the logits (lm_head, or a tied embedding)."""
    return "lm_head" in name or "embed_tokens" in name


def matmul_bound(runner: ModelRunner, rows: int, head_rows: int, repeats: int) -> tuple[float, float]:
    """Every weight matmul of one forward: the layers' on `rows` token rows, the lm_head on `head_rows`
    (the sampled ones). Returns (best seconds, multiply-adds x 2)."""
    modules = [(name, m) for name, m in runner.model.named_modules()
               if isinstance(m, (QuantizedLinearCPU, QuantizedEmbeddingCPU))]
    if modules:
        xs, calls, flops = {}, [], 0
        for name, m in modules:
            if isinstance(m, QuantizedLinearCPU):  # a fused gate/up computes both halves of its one column
                k, n = m.in_features, sum(m.columns) * (2 if m.glu else 1)
            else:
                k, n = m.dims, m.num_embeddings
            r = head_rows if is_head(name) else rows
            xs.setdefault((r, k), mx.random.normal((r, k)))
            calls.append((m.as_linear if isinstance(m, QuantizedEmbeddingCPU) else m, (r, k)))
            flops += 2 * r * k * n
        mx.eval(list(xs.values()))
        return best_of(lambda: mx.eval([fn(xs[key]) for fn, key in calls]), repeats), flops
    weights = [(name, w) for name, w in tree_flatten(runner.model.parameters())
               if w.ndim == 2 and ("proj" in name or is_head(name))]
    x = {(r, w.shape[1]): mx.random.normal((r, w.shape[1]))
         for name, w in weights for r in [head_rows if is_head(name) else rows]}
    mx.eval(list(x.values()))
    pairs = [(x[(head_rows if is_head(name) else rows, w.shape[1])], w) for name, w in weights]
    flops = sum(2 * a.shape[0] * w.shape[0] * w.shape[1] for a, w in pairs)
    return best_of(lambda: mx.eval([a @ w.T for a, w in pairs]), repeats), flops


def attention_only(runner: ModelRunner, batch: int, context: int, chunk: int, repeats: int) -> float:
    mc = runner.model_config
    md = step_metadata(runner, batch, context, chunk)
    q = mx.random.normal((batch * chunk, mc.num_attention_heads, mc.head_dim))
    pools = [runner.kv_cache.layer(i) for i in range(mc.num_hidden_layers)]  # each layer's own: read from DRAM

    def run():
        mx.eval([paged_attention(q, k, v, md, mc.head_dim ** -0.5) for k, v in pools])
    return best_of(run, repeats)


def set_decode_fusions(runner: ModelRunner, on: bool) -> None:
    """Turn this branch's decode-step fusions on or off in a loaded runner (for --ab): the threaded argmax
    (kernels.sampling) and the residual add fused into the next RMSNorm (RMSNorm.add_and_norm); off is
    the graph of before (mx.argmax; an Add node, then the norm)."""
    runner.sampler = Sampler(runner.model_config.vocab_size, eos_token_ids=runner.sampler.eos_token_ids, seed=0,
                             backend=runner.backends.activations if on else "reference")
    for _, module in runner.model.named_modules():
        if isinstance(module, RMSNorm):
            module._fused_add = on and module._kernel and ext.load() is not None


def ab_steps(runner: ModelRunner, step: StepInput, repeats: int) -> dict[str, float]:
    """step_ms with the fusions on and off, alternated in one run (a shared machine drifts): best and median."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * (repeats + 1)):
        which = "on" if i % 2 == 0 else "off"
        set_decode_fusions(runner, which == "on")
        start = time.perf_counter()
        runner.execute(step)
        if i >= 2:  # the first pair warms up
            times[which].append((time.perf_counter() - start) * 1e3)
    set_decode_fusions(runner, True)
    return {f"{stat}_{which}_ms": round(fn(sorted(values)), 2) for which, values in times.items()
            for stat, fn in (("best", lambda v: v[0]), ("median", lambda v: v[len(v) // 2]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=256, help="tokens cached before the step, per sequence")
    parser.add_argument("--chunk", type=int, default=1, help="new tokens per sequence: 1 decodes, more is a "
                        "prompt chunk (--ab needs 1)")
    parser.add_argument("--dtype", default="auto", help="EngineConfig.dtype: auto (quantized kernels) or float32")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--model", default=None, help="a GGUF file or model id (default: EngineConfig's)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig.kv_cache_dtype (auto, float32, float16, "
                        "bfloat16, int8)")
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="KV pool size: batch x context must fit")
    parser.add_argument("--pages", choices=("huge", "mlx"), default="huge",
                        help="the packed weights on huge pages as the loader puts them, or left on MLX's own "
                             "4 KiB pages (for an A/B of the huge pages: run both, alternated)")
    parser.add_argument("--read-roof", action="store_true",
                        help="also measure the read bandwidth (roofline_probe.c) and the weights' share of it")
    parser.add_argument("--read-roof-mib", type=int, default=1024, help="the read probe's buffer (larger than the caches)")
    parser.add_argument("--read-roof-rounds", type=int, default=3,
                        help="rounds of (read probe, step, matmuls) for the shares (medians of the rounds)")
    parser.add_argument("--ab", action="store_true",
                        help="only step_ms with the decode fusions on and off, alternated (set_decode_fusions)")
    args = parser.parse_args()
    if args.ab and args.chunk != 1:
        parser.error("--ab times decode steps: --chunk must be 1")
    if args.read_roof_rounds < 1:
        parser.error("--read-roof-rounds must be >= 1")
    if args.pages == "mlx":  # the loader's weights are packed by kernels.qmm.pack_layers
        qmm.PLACE_ON_HUGE_PAGES = False
    model = {"model": args.model} if args.model else {}
    runner = ModelRunner.load(EngineConfig(kv_cache_bytes=args.kv_cache_mib << 20, dtype=args.dtype,
                                           kv_cache_dtype=args.kv_cache_dtype, **model))
    step = profiled_step(runner, args.batch, args.context, args.chunk)
    if args.ab:
        print(json.dumps({"model": args.model or "default", "batch": args.batch, "context": args.context,
                          **ab_steps(runner, step, args.repeat)}))
        return
    full = best_of(lambda: runner.execute(step), args.repeat)
    parts = phases(runner, step, args.repeat)
    bound, flops = matmul_bound(runner, args.batch * args.chunk, args.batch, args.repeat)
    attn = attention_only(runner, args.batch, args.context, args.chunk, args.repeat)
    ops = op_costs(runner, args.batch, args.context, args.chunk, args.repeat)
    nodes, kinds = graph_nodes(runner, step)
    result = {"model": args.model or "default",
              "batch": args.batch, "context": args.context, "chunk": args.chunk, "dtype": args.dtype,
              "kv_cache_dtype": str(runner.kv_cache.dtype).removeprefix("mlx.core."),
              "backends": select_backends().describe(), "cpu_isa": ext.cpu_isa(),
              "attention_backend": attention_backend(), "step_ms": round(full * 1e3, 2),
              **{k: round(v, 2) for k, v in parts.items()},
              "matmul_ms": round(bound * 1e3, 2), "attention_ms": round(attn * 1e3, 2),
              "matmul_gflops": round(flops / bound * 1e-9, 1), "step_gflops": round(flops / full * 1e-9, 1),
              "ops_ms": ops, "other_ms": round((full - bound - attn) * 1e3 - sum(ops.values()), 2),
              "graph_nodes": nodes, "node_kinds": kinds,
              "matmul_share": round(bound / full, 3), "attention_share": round(attn / full, 3),
              "pages": args.pages, "huge_page_mib": ext.anon_huge_page_bytes() >> 20,
              "weight_mib": round(weight_bytes(runner) / 2**20, 1),
              "weight_gbs_step": round(weight_bytes(runner) / full * 1e-9, 2),
              "weight_gbs_matmul": round(weight_bytes(runner) / bound * 1e-9, 2)}
    if args.read_roof:
        result.update(read_roof(runner, step, args))
    print(json.dumps(result, indent=2))


def read_roof(runner: ModelRunner, step: StepInput, args: argparse.Namespace) -> dict:
    """args.read_roof_rounds rounds of the read probe's GB/s (4 KiB and huge pages, wall), each followed by the
    step's and the matmuls' read rates; per round the rates as shares of the probe's higher one, and the medians."""
    from benchmarks.qmm_roofline import roofs  # noqa: PLC0415  (compiles the probe: only with --read-roof)

    nbytes, rounds = weight_bytes(runner), []
    for _ in range(args.read_roof_rounds):
        roof = roofs(ext.cpu_isa() or "", ext.load().num_threads(), args.read_roof_mib)  # the kernels' thread count
        if not roof:
            return {"read_roof": "no C compiler or no probe for this instruction set"}
        step_s = best_of(lambda: runner.execute(step), args.repeat)
        matmul_s, _ = matmul_bound(runner, args.batch * args.chunk, args.batch, args.repeat)
        best = max(roof["read_gbs_wall"], roof["read_huge_gbs_wall"])
        rounds.append({"read_gbs": roof["read_gbs_wall"], "read_huge_gbs": roof["read_huge_gbs_wall"],
                       "weight_gbs_step": round(nbytes / step_s * 1e-9, 2),
                       "weight_gbs_matmul": round(nbytes / matmul_s * 1e-9, 2),
                       "share_step": round(nbytes / step_s * 1e-9 / best, 3),
                       "share_matmul": round(nbytes / matmul_s * 1e-9 / best, 3)})
    median = {key: round(statistics.median(r[key] for r in rounds), 3) for key in rounds[0]}
    return {"read_gbs": median["read_gbs"], "read_huge_gbs": median["read_huge_gbs"],
            "huge_pages_advised": roof["huge_pages_advised"], "read_roof_rounds": rounds,
            "weight_read_share_step": median["share_step"], "weight_read_share_matmul": median["share_matmul"]}


if __name__ == "__main__":
    main()
