"""Greedy verification of a step's speculative segments.

For a segment of the last known token x and k drafts d1..dk, the target's logits at its k + 1 rows
give its own next tokens t0..tk (t_i follows d_i, t0 follows x). The accepted run is d1..da where
d_i == t_{i-1} for every i <= a, then t_a: the target's token at the first mismatch, or the bonus
token after k accepted. One argmax over every segment's rows and one .tolist() per step.
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels.runtime import mx


def accepted_runs(logits: mx.array, drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """logits (sum(k_i + 1), V) of the segments in order, drafts[i] the k_i drafts of segment i ->
    per segment its accepted drafts followed by the target's own token (1 to k_i + 1 tokens)."""
    targets = mx.argmax(logits, axis=-1).tolist()  # (sum(k_i + 1),)
    runs, row = [], 0
    for segment in drafts:
        mine = targets[row:row + len(segment) + 1]
        accepted = 0
        while accepted < len(segment) and segment[accepted] == mine[accepted]:
            accepted += 1
        runs.append([*segment[:accepted], mine[accepted]])
        row += len(segment) + 1
    return runs
