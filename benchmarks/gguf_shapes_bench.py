"""metrale on bigger GGUF shapes, with random weights written here by the `gguf` package:

    llama-1b   Llama-3.2-1B's shape (16 layers, hidden 2048, 32 / 8 heads of 64, ffn 8192, vocab 128256,
               tied), Q4_0
    llama-3b   Llama-3.2-3B's shape (28 layers, hidden 3072, 24 / 8 heads of 128, ffn 8192, vocab 128256,
               tied), Q4_0
    qwen3moe   a Qwen3-MoE shape of ~1.1B parameters (24 layers, hidden 1024, 16 / 4 heads of 64, 16 experts
               of 768, top-4, vocab 151936, tied), Q4_0; the router in float32 as llama.cpp keeps it

Random Q4_0 blocks (scales ~ 1 / (4.6 sqrt(K)), uniform nibbles) are written straight as bytes, so a file
takes seconds; the files say a context length of 8192 (CONTEXT_LENGTH), and an existing file is reused
only when its metadata is the shape's (read_shape). Measured in process (AsyncEngine, metrale's load
generator): output throughput and TTFT at 1 and 8 streams of --prompt-len 128 / --output-len 64 (greedy,
ignore_eos, random token-id prompts), and prompt throughput of one --long-prompt-len 512 prompt
(512 / TTFT). Against llama.cpp on the same files: benchmarks/peer_matrix.py (llama-1b, llama-3b), or
benchmarks/compare_peers.py --model FILE (the command is printed).

    .venv/bin/python benchmarks/gguf_shapes_bench.py [--shapes llama-1b qwen3moe] [--dir /tmp/metrale-shapes]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import struct
import sys
import time
from pathlib import Path

import gguf
import numpy as np

SHAPES = {
    "llama-1b": {"arch": "llama", "layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "head_dim": 64,
                 "ffn": 8192, "vocab": 128256, "rope_theta": 500000.0},
    "llama-3b": {"arch": "llama", "layers": 28, "hidden": 3072, "heads": 24, "kv_heads": 8, "head_dim": 128,
                 "ffn": 8192, "vocab": 128256, "rope_theta": 500000.0},
    "qwen3moe": {"arch": "qwen3moe", "layers": 24, "hidden": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64,
                 "ffn": 768, "vocab": 151936, "rope_theta": 1000000.0, "experts": 16, "top_k": 4},
}
Q4_0 = gguf.GGMLQuantizationType.Q4_0
CONTEXT_LENGTH = 8192  # what the written files say: room for a 4k-token prompt and more
SHAPE_KEYS = ("arch", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab")  # what read_shape reads


def expected_shape(name: str, *, layers: int | None = None, context_length: int = CONTEXT_LENGTH) -> dict:
    """read_shape's answer for a file write_shape(name, layers=..., context_length=...) wrote."""
    s = SHAPES[name]
    shape = {k: s[k] for k in SHAPE_KEYS} | {"context_length": context_length}
    if layers is not None:
        shape["layers"] = layers
    if "experts" in s:
        shape |= {"experts": s["experts"], "top_k": s["top_k"]}
    return shape


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_metadata(path: Path) -> dict[str, object]:
    """A GGUF's key-value metadata: scalars and strings as values, arrays as their length. Parsed here
    (gguf.GGUFReader takes seconds on a 128k-token vocabulary: it makes an array per token)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        offset = 24  # magic, version (u32), tensor count (u64)
        (count,) = struct.unpack_from("<Q", data, 16)

        def string() -> str:
            nonlocal offset
            (n,) = struct.unpack_from("<Q", data, offset)
            offset += 8 + n
            return data[offset - n:offset].decode("utf-8", errors="replace")

        def scalar(kind: int) -> object:
            nonlocal offset
            if kind == _STRING:
                return string()
            value = struct.unpack_from(_SCALARS[kind], data, offset)[0]
            offset += struct.calcsize(_SCALARS[kind])
            return value

        metadata: dict[str, object] = {}
        for _ in range(count):
            key = string()
            (kind,) = struct.unpack_from("<I", data, offset)
            offset += 4
            if kind != _ARRAY:
                metadata[key] = scalar(kind)
                continue
            item, n = struct.unpack_from("<IQ", data, offset)
            offset += 12
            if item == _ARRAY:
                raise ValueError(f"{path}: an array of arrays in {key}")
            if item == _STRING:
                for _ in range(n):
                    string()
            else:
                offset += n * struct.calcsize(_SCALARS[item])
            metadata[key] = n
    return metadata


def read_shape(path: Path) -> dict:
    """The model shape a GGUF's metadata states (any llama-like file, e.g. the default 135M model): arch,
    layers, hidden, heads, kv_heads, head_dim, ffn, vocab, context_length (+ experts, top_k for MoE)."""
    fields = read_metadata(path)
    arch = fields.get("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: no general.architecture in the GGUF metadata")
    hidden, heads = fields[f"{arch}.embedding_length"], fields[f"{arch}.attention.head_count"]
    shape = {"arch": arch, "layers": fields[f"{arch}.block_count"], "hidden": hidden, "heads": heads,
             "kv_heads": fields.get(f"{arch}.attention.head_count_kv", heads),
             "head_dim": fields.get(f"{arch}.attention.key_length", hidden // heads),
             "ffn": fields.get(f"{arch}.feed_forward_length"),
             "vocab": fields.get(f"{arch}.vocab_size") or fields["tokenizer.ggml.tokens"],
             "context_length": fields[f"{arch}.context_length"]}
    if f"{arch}.expert_count" in fields:
        shape |= {"experts": fields[f"{arch}.expert_count"], "top_k": fields[f"{arch}.expert_used_count"],
                  "ffn": fields.get(f"{arch}.expert_feed_forward_length", shape["ffn"])}
    return shape


def q4_0_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random Q4_0 blocks for a float tensor of `shape` (..., K): (..., K / 32 * 18) uint8."""
    *lead, k = shape
    blocks = (*lead, k // 32)
    scale = (rng.uniform(0.5, 1.5, blocks) / (4.6 * np.sqrt(k))).astype(np.float16)
    nibbles = rng.integers(0, 256, (*blocks, 16), dtype=np.uint8)
    return np.concatenate([scale[..., None].view(np.uint8), nibbles], axis=-1).reshape(*lead, -1)


def byte_level_tokens(vocab: int) -> tuple[list[str], list[str]]:
    """(tokens, merges): 3 control tokens, GPT-2's 256 byte characters, one merge, fillers up to `vocab`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = [], 0
    for byte in range(256):
        chars.append(chr(byte) if byte in printable else chr(256 + extra))
        extra += byte not in printable
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, "\u0120t"]
    return tokens + [f"x{i}" for i in range(vocab - len(tokens))], ["\u0120 t"]


def write_shape(path: Path, name: str, seed: int = 0, *, layers: int | None = None,
                context_length: int = CONTEXT_LENGTH) -> Path:
    """A random-weight GGUF of SHAPES[name] at `path` (`layers` overrides the layer count: a small file
    with the shape's metadata otherwise). An existing file is kept when its metadata is that shape's;
    otherwise it is replaced (written beside it, then renamed: a reader of the old file keeps it)."""
    if path.is_file() and read_shape(path) == expected_shape(name, layers=layers, context_length=context_length):
        return path
    shape = SHAPES[name] | ({} if layers is None else {"layers": layers})
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write_gguf(partial, shape, np.random.default_rng(seed), context_length)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def write_gguf(path: Path, s: dict, rng: np.random.Generator, context_length: int) -> None:
    """The GGUF of shape `s` (a SHAPES entry), random Q4_0 weights from `rng`, at `path`."""
    arch, d, hd = s["arch"], s["hidden"], s["head_dim"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context_length)
    writer.add_embedding_length(d)
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_vocab_size(s["vocab"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    if "experts" in s:
        writer.add_expert_count(s["experts"])
        writer.add_expert_used_count(s["top_k"])
        writer.add_expert_feed_forward_length(s["ffn"])
    tokens, merges = byte_level_tokens(s["vocab"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3, 3, 3] + [1] * (s["vocab"] - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)

    def quantized(tensor: str, *shape: int) -> None:
        writer.add_tensor(tensor, q4_0_bytes(rng, shape), raw_dtype=Q4_0)

    def ones(tensor: str, n: int) -> None:
        writer.add_tensor(tensor, np.ones(n, dtype=np.float32))

    quantized("token_embd.weight", s["vocab"], d)
    ones("output_norm.weight", d)
    for i in range(s["layers"]):
        b = f"blk.{i}"
        ones(f"{b}.attn_norm.weight", d)
        ones(f"{b}.ffn_norm.weight", d)
        quantized(f"{b}.attn_q.weight", s["heads"] * hd, d)
        quantized(f"{b}.attn_k.weight", s["kv_heads"] * hd, d)
        quantized(f"{b}.attn_v.weight", s["kv_heads"] * hd, d)
        quantized(f"{b}.attn_output.weight", d, s["heads"] * hd)
        if "experts" in s:
            ones(f"{b}.attn_q_norm.weight", hd)
            ones(f"{b}.attn_k_norm.weight", hd)
            router = (rng.standard_normal((s["experts"], d)) / np.sqrt(d)).astype(np.float32)
            writer.add_tensor(f"{b}.ffn_gate_inp.weight", router)
            quantized(f"{b}.ffn_gate_exps.weight", s["experts"], s["ffn"], d)
            quantized(f"{b}.ffn_up_exps.weight", s["experts"], s["ffn"], d)
            quantized(f"{b}.ffn_down_exps.weight", s["experts"], d, s["ffn"])
        else:
            quantized(f"{b}.ffn_gate.weight", s["ffn"], d)
            quantized(f"{b}.ffn_up.weight", s["ffn"], d)
            quantized(f"{b}.ffn_down.weight", d, s["ffn"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


async def measure(path: Path, vocab: int, args: argparse.Namespace) -> dict:
    """Output throughput / TTFT at each stream count, and the long prompt's throughput, in process."""
    from metrale import AsyncEngine, EngineConfig
    from metrale.bench.loadgen import BenchSettings, run_benchmark
    from metrale.bench.targets import EngineTarget
    from metrale.bench.workloads import random_requests

    start = time.perf_counter()
    async with AsyncEngine(EngineConfig(model=str(path), max_num_seqs=max(8, *args.streams))) as engine:
        load_s = time.perf_counter() - start
        target = EngineTarget(engine)
        await run_benchmark(target, random_requests(2, 32, 4, seed=99, vocab_size=vocab), show_progress=False)
        out = {"load_s": round(load_s, 1), "levels": []}
        for streams in args.streams:
            requests = random_requests(streams, args.prompt_len, args.output_len, seed=streams, vocab_size=vocab)
            r = await run_benchmark(target, requests, BenchSettings(max_concurrency=streams), show_progress=False)
            out["levels"].append({"streams": streams, "output_tok_s": round(r["output_throughput"], 2),
                                  "mean_ttft_s": round(r["mean_ttft_ms"] / 1e3, 3),
                                  "mean_tpot_ms": round(r["mean_tpot_ms"], 1), "failed": r["failed"]})
            print(f"# {path.name} {streams} streams: {r['output_throughput']:.1f} tok/s, "
                  f"TTFT {r['mean_ttft_ms'] / 1e3:.2f} s", file=sys.stderr, flush=True)
        long = random_requests(1, args.long_prompt_len, 1, seed=7, vocab_size=vocab)
        r = await run_benchmark(target, long, show_progress=False)
        out["prompt_tok_s"] = round(args.long_prompt_len / (r["mean_ttft_ms"] / 1e3), 1)
        print(f"# {path.name} {args.long_prompt_len}-token prompt: {out['prompt_tok_s']} tok/s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["llama-1b", "qwen3moe"])
    parser.add_argument("--dir", default="/tmp/metrale-shapes", help="where the GGUFs are written (and reused)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--long-prompt-len", type=int, default=512)
    parser.add_argument("--write-only", action="store_true", help="write the files and print the peer commands")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.shapes:
        started = time.perf_counter()
        path = write_shape(folder / f"{name}-q4_0.gguf", name)
        print(f"# {path} ({path.stat().st_size / 2**30:.2f} GiB, {time.perf_counter() - started:.0f} s)",
              file=sys.stderr)
        print(f"# llama.cpp: benchmarks/compare_peers.py --model {path} --engines metrale llama.cpp "
              f"--metrale-in-process --streams {' '.join(map(str, args.streams))} --prompt-len {args.prompt_len} "
              f"--output-len {args.output_len} --rounds 1", file=sys.stderr)
        if not args.write_only:
            results[name] = asyncio.run(measure(path, SHAPES[name]["vocab"], args))
    if results:
        text = json.dumps(results, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
