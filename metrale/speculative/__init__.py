"""Speculative decoding inside the batched engine.

A request that speculates has k draft tokens computed with its last token, as one (k+1)-token segment
of the step's flat batch (causal within itself, next to the other requests' decodes and prefill
chunks); the target's logits at each of its rows verify the drafts. Greedy verification is exact: the
accepted drafts are those equal to the target's own argmax, followed by the target's token at the
first mismatch (or the bonus token after k accepted), so the output equals non-speculative greedy.
Sampled requests (temperature > 0) are not speculated, so nothing changes what a seeded request
produces; neither are requests with penalties, logprobs or a min_tokens ban still in force.

    config.py       SpeculativeConfig: {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}
    proposers.py    the proposer interfaces (HostProposer, RunnerProposer) and n-gram prompt lookup (pure Python)
    policy.py       who speculates this step and with how many drafts (acceptance-adaptive, off as the batch fills)
    draft_model.py  the runner-side proposer: a smaller model of the same tokenizer, its own paged KV
    verify.py       greedy verification of a step's speculative segments (one argmax, one .tolist())

Proposers come in two kinds. Host-side ones (`HostProposer`: n-gram lookup, or a test's oracle) run on
the event loop before `schedule()` and hand their drafts to the scheduler. Runner-side ones
(`RunnerProposer`: `draft_model.DraftModelProposer`) run on the MLX thread inside the step, given the
request's tokens and block table; a model's own multi-token-prediction heads would be one of these (it would read the
target's hidden states of the previous step): none of the models metrale loads has such heads.
"""
