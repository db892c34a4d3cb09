"""Sampling: one token per row of a step's logits, every row with its own parameters.

    batch.py        host side: per-request SamplingParams -> the step's SamplingBatch (arrays built once)
    ops.py          device side: masks, bias, penalties, greedy, temperature / min_p / top_k / top_p, inverse CDF
    logprobs.py     raw log-probabilities of the sampled tokens and their top alternatives
    sampler.py      Sampler: prepare (host) then sample (device), one evaluation per step (rarely two)
    guided.py       llguidance grammars: GrammarCompiler (own thread, cached), per-request GrammarMatcher
    constraints.py  TokenConstraints: per-request matchers / allowed-token masks across steps (MLX thread)
"""

from metrale.sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput"]
