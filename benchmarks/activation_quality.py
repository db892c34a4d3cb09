"""What each activation precision of the quantized CPU kernels costs in output quality, on the real
default model, measured against the same weights dequantized to float32.

    .venv/bin/python benchmarks/activation_quality.py                     # int16, int12, int8
    .venv/bin/python benchmarks/activation_quality.py --tokens 256 --greedy-steps 32 --json out.json

For each precision (METRALE_QMM_ACTIVATIONS: the kernels quantize each token's activations per 32
values before the integer dot products), two measurements:

- teacher forcing over texts every Python install carries (sections of the reference manual from
  `pydoc_data.topics`, the source of `textwrap`): per position, the KL divergence of the precision's
  next-token distribution from float32's, whether its argmax agrees, and the text's perplexity;
- greedy chats (the model's own chat template, its system prompt included): how many continue
  exactly as float32 does for `--greedy-steps` tokens, and where the others first differ.

For scale, the same measurements for the float32 model with its weights rounded once more, to
8 bits per 32 and to 4 bits per 64 (MLX's affine quantization, dequantized again: float32 matmuls on
the rounded values; every Linear, not the tied embedding): what one more weight rounding of a Q8_0 or
a Q4 file costs. All runs share the KV cache dtype (float32) and the forward code; only
the matmuls' arithmetic differs. KL is in nats.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from pydoc_data.topics import topics  # noqa: E402

from metrale.loading.gguf import LoadedModel, load_gguf  # noqa: E402
from metrale.models.cpu_quantized import set_activation_bits  # noqa: E402
from metrale.text.chat_template import ChatTemplate  # noqa: E402
from tests.metrale.model_helpers import PagedHarness  # noqa: E402

TOPICS = ("assignment", "execmodel", "customization", "import", "compound", "types")
QUESTIONS = (
    "What is the capital of France?", "Write a haiku about the sea.", "List three fruits.",
    "Explain what a hash table is in two sentences.", "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.", "Give me a name for a black cat.",
    "What is 12 times 11?", "Why is the sky blue?", "Write a Python function that reverses a string.",
    "What should I pack for a weekend of hiking?", "Summarize the plot of Romeo and Juliet.",
)
# auto: int8 for calls of kernels.backend.INT8_MIN_TOKENS rows or more, int16 below; here that is int8 for the
# teacher-forced texts and the chats' prompts, int16 for the chats' decode steps (fewer chats than 16): what
# int8 prompts with precise decode steps cost (`--precisions auto`; not in the default list)
PRECISIONS = {"int16": 16, "int12": 12, "int8": 8, "auto": 0}
DEFAULT_PRECISIONS = ["int16", "int12", "int8"]


def texts(tokenizer, max_tokens: int) -> dict[str, list[int]]:
    """Name -> token ids (at most max_tokens) of each teacher-forced text."""
    sources = {f"manual:{name}": topics[name] for name in TOPICS}
    sources["code:textwrap"] = inspect.getsource(textwrap)
    return {name: tokenizer.encode(text)[:max_tokens] for name, text in sources.items()}


def chats(loaded: LoadedModel) -> list[list[int]]:
    template = ChatTemplate.for_tokenizer(loaded.tokenizer, loaded.config.architecture)
    return [loaded.tokenizer.encode(template.render([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in QUESTIONS]


def forced_logprobs(loaded: LoadedModel, ids: list[int]) -> mx.array:
    """Log-probabilities (len(ids) - 1, vocab) of each next token, one prompt step."""
    harness = PagedHarness(loaded.config, num_blocks=len(ids) // 16 + 2, block_size=16)
    logits = harness.step(loaded.model, [("s", ids)])[0][:-1].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def greedy(loaded: LoadedModel, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """`steps` greedy tokens per prompt, all prompts batched (PagedHarness.greedy)."""
    blocks = len(prompts) * ((max(map(len, prompts)) + steps) // 16 + 2)
    return PagedHarness(loaded.config, num_blocks=blocks, block_size=16).greedy(loaded.model, prompts, steps)[1]


def nll(logprobs: mx.array, ids: list[int]) -> float:
    """The text's negative log-likelihood: -sum of each next token's log-probability."""
    return -float(mx.sum(mx.take_along_axis(logprobs, mx.array(ids[1:])[:, None], axis=-1)).item())


def compare(reference: dict, candidate: dict, ref_greedy: list[list[int]], cand_greedy: list[list[int]]) -> dict:
    kls, agree, nll_ref, nll_cand, positions = [], 0, 0.0, 0.0, 0
    for name, (ref_lp, ids) in reference.items():
        cand_lp = candidate[name][0]
        kl = mx.sum(mx.exp(ref_lp) * (ref_lp - cand_lp), axis=-1)  # (positions,)
        kls.extend(kl.tolist())
        agree += int(mx.sum(mx.argmax(ref_lp, axis=-1) == mx.argmax(cand_lp, axis=-1)).item())
        nll_ref += nll(ref_lp, ids)
        nll_cand += nll(cand_lp, ids)
        positions += len(ids) - 1
    kls.sort()
    first_diff = [next((i for i, (a, b) in enumerate(zip(r, c)) if a != b), None)
                  for r, c in zip(ref_greedy, cand_greedy)]
    return {
        "positions": positions,
        "kl_mean": sum(kls) / len(kls), "kl_p99": kls[int(0.99 * (len(kls) - 1))], "kl_max": kls[-1],
        "top1_agree": agree / positions,
        "ppl_ratio": math.exp((nll_cand - nll_ref) / positions),
        "greedy_identical": sum(d is None for d in first_diff), "greedy_prompts": len(first_diff),
        "greedy_first_diff": [d for d in first_diff if d is not None],
    }


def round_weights(model: nn.Module, bits: int, group: int) -> None:
    """Every Linear's float32 weight rounded to `bits` per `group` (MLX's affine quantization) and kept in
    float32: only the weights' values change, the matmuls stay float32."""
    for _, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.weight = mx.dequantize(*mx.quantize(module.weight, group_size=group, bits=bits),
                                          group_size=group, bits=bits).astype(module.weight.dtype)
    mx.eval(model.parameters())


def measure(loaded: LoadedModel, corpus: dict[str, list[int]], prompts: list[list[int]], steps: int):
    forced = {name: (forced_logprobs(loaded, ids), ids) for name, ids in corpus.items()}
    for lp, _ in forced.values():
        mx.eval(lp)
    return forced, greedy(loaded, prompts, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per teacher-forced text")
    parser.add_argument("--greedy-steps", type=int, default=48)
    parser.add_argument("--precisions", nargs="+", default=DEFAULT_PRECISIONS, choices=list(PRECISIONS))
    parser.add_argument("--no-weight-rounding", action="store_true", help="skip the weight re-rounding rows")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    reference_model = load_gguf(dtype=mx.float32)
    corpus = texts(reference_model.tokenizer, args.tokens)
    prompts = chats(reference_model)
    reference, ref_greedy = measure(reference_model, corpus, prompts, args.greedy_steps)
    ppl = math.exp(sum(nll(lp, ids) for lp, ids in reference.values())
                   / sum(len(ids) - 1 for _, ids in reference.values()))
    print(f"float32 reference: {sum(len(i) for i in corpus.values())} tokens in {len(corpus)} texts, "
          f"perplexity {ppl:.3f}; {len(prompts)} chats x {args.greedy_steps} greedy tokens")

    rows: dict[str, dict] = {}
    quantized = load_gguf()
    for name in args.precisions:
        set_activation_bits(quantized.model, PRECISIONS[name])
        forced, outs = measure(quantized, corpus, prompts, args.greedy_steps)
        rows[f"activations {name}"] = compare(reference, forced, ref_greedy, outs)
        print_row(f"activations {name}", rows[f"activations {name}"])
    if not args.no_weight_rounding:
        for bits, group in ((8, 32), (4, 64)):
            rounded = load_gguf(dtype=mx.float32)
            round_weights(rounded.model, bits, group)
            label = f"float32, weights re-rounded to {bits} bits / {group}"
            forced, outs = measure(rounded, corpus, prompts, args.greedy_steps)
            rows[label] = compare(reference, forced, ref_greedy, outs)
            print_row(label, rows[label])
    if args.json:
        args.json.write_text(json.dumps({"reference_perplexity": ppl, "rows": rows}, indent=1))


def print_row(label: str, row: dict) -> None:
    print(f"{label:42s} KL mean {row['kl_mean']:.2e} p99 {row['kl_p99']:.2e} max {row['kl_max']:.2e}  "
          f"top-1 {100 * row['top1_agree']:.2f}%  ppl x{row['ppl_ratio']:.4f}  "
          f"greedy identical {row['greedy_identical']}/{row['greedy_prompts']} "
          f"(first differences at {row['greedy_first_diff']})", flush=True)


if __name__ == "__main__":
    main()
