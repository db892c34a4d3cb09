"""How long a peer_matrix run will take and how much memory its servers want, from the model shapes
alone: a roofline-like model calibrated on the idle 2-core AMD EPYC (AVX-512 VNNI) this project's runs
use, metrale's 1B-shape figures of benchmarks/results/shapes_llama_1b_idle*.json (the slower engine
there, so an upper-ish bound). Rough by design; the run's JSON records the real times.

    seconds = cell_seconds(shape, weight_bytes, prompt_len=512, output_len=64, streams=8)
"""

from __future__ import annotations

import math
from typing import Mapping

PROMPT_FLOPS = 200e9  # flop/s a prompt chunk reaches (1B: 512 tokens in ~5 s)
DECODE_FLOPS = 150e9  # flop/s of a batched decode step when it is compute-bound (1B: 8 streams, ~0.125 s/step)
READ_BYTES_S = 10e9  # weight bytes/s a one-stream decode step streams (1B: ~62 ms/token for 0.7 GB)
STEP_OVERHEAD_S = 0.005  # per decode step: host work, HTTP, sampling
RUN_OVERHEAD_S = 4.0  # per run: the quiet-machine check (3 s) and the client
START_S, LOAD_BYTES_S = 10.0, 300e6  # a server's start: fixed + per weight byte (load, repack)
WRITE_BYTES_S = 100e6  # writing a random-weight GGUF
Q4_0_BYTES_PER_WEIGHT = 18 / 32
KV_BYTES_PER_ELEMENT = 2  # float16 KV for both engines
BLOCK_TOKENS = 16  # metrale's default KV block


def parameters(shape: Mapping[str, int]) -> int:
    """Weights a token's forward pass multiplies (the tied embedding once, as the output matmul)."""
    d, hd = shape["hidden"], shape["head_dim"]
    attention = d * shape["heads"] * hd * 2 + d * shape["kv_heads"] * hd * 2
    return shape["vocab"] * d + shape["layers"] * (attention + 3 * d * shape["ffn"])


def weight_bytes(shape: Mapping[str, int]) -> int:
    """A Q4_0 file's weight bytes for `shape` (the norms left out)."""
    return int(parameters(shape) * Q4_0_BYTES_PER_WEIGHT)


def kv_bytes_per_token(shape: Mapping[str, int]) -> int:
    """K and V of every layer for one token, float16."""
    return shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * KV_BYTES_PER_ELEMENT


def kv_cache_mib(shape: Mapping[str, int], sequences: int, context: int) -> int:
    """metrale's --kv-cache-mib for `sequences` of `context` tokens each (a block of slack per sequence)."""
    tokens = sequences * (math.ceil(context / BLOCK_TOKENS) + 1) * BLOCK_TOKENS
    return math.ceil(tokens * kv_bytes_per_token(shape) / 2**20)


def prompt_seconds(shape: Mapping[str, int], tokens: int, prompt_len: int) -> float:
    """Processing `tokens` prompt tokens in prompts of `prompt_len`: the matmuls and causal attention."""
    attention = 2 * shape["layers"] * shape["heads"] * shape["head_dim"] * prompt_len  # flop per token, mean
    return tokens * (2 * parameters(shape) + attention) / PROMPT_FLOPS


def cell_seconds(shape: Mapping[str, int], file_bytes: int, *, prompt_len: int, output_len: int,
                 streams: int) -> float:
    """One engine's run of one cell: every prompt, then `output_len` decode steps of `streams` tokens."""
    step = max(file_bytes / READ_BYTES_S, streams * 2 * parameters(shape) / DECODE_FLOPS) + STEP_OVERHEAD_S
    return RUN_OVERHEAD_S + prompt_seconds(shape, streams * prompt_len, prompt_len) + output_len * step


def start_seconds(file_bytes: int) -> float:
    """A server's start on a file of `file_bytes`."""
    return START_S + file_bytes / LOAD_BYTES_S


def write_seconds(file_bytes: int) -> float:
    return file_bytes / WRITE_BYTES_S
