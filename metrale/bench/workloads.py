"""What each benchmark request asks for: seeded random lengths, a shared-system-prompt chat set, prompts that
repeat a few prefixes (vLLM's prefix_repetition), conversations from a ShareGPT-format JSON file, or a custom
JSONL file of prompts.

A `BenchRequest` carries a completion prompt (token ids for the in-process engine, text for HTTP)
or chat messages, with its prompt length and the number of tokens to generate. Text prompts are
random common English words, about one token each on BPE vocabularies; their exact token count is
what the target reports back (usage), not `prompt_len`, which is then an estimate.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

WORDS = tuple(dict.fromkeys("""the of and to in is was for on that with as by at from his it an were are which this be or
has had not first one their its new after but who they have her she two been other when there all during
into school time may years more most only over city some world would where later up such used many can state
about national out known university united then made three also under film group between him both american
than family part early season second before series well team through three these including game work however
war number called several house water music since long country people while played back history life old
around government south north river small place each area four left public being until high best king year
age light air open line order power road stone field point table voice world wind cloud green bread train
""".split()))
TOKEN_ID_LOW = 100  # random token ids start here, above the special and byte tokens of common vocabularies


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: `prompt` (str or token ids) or chat `messages`, never both."""

    prompt_len: int
    output_len: int
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a BenchRequest has either a prompt or messages")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's --random-range-ratio)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def random_words(rng: random.Random, n: int) -> str:
    """n random common words, space separated."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_requests(num_requests: int, input_len: int, output_len: int, *, seed: int = 0,
                    range_ratio: float = 0.0, vocab_size: int | None = None) -> list[BenchRequest]:
    """Random prompts and output lengths. With `vocab_size` the prompts are token ids in
    [TOKEN_ID_LOW, vocab_size) of exactly the drawn length; without, they are text of that many words."""
    if vocab_size is not None and vocab_size <= TOKEN_ID_LOW:
        raise ValueError(f"vocab_size must be > {TOKEN_ID_LOW}, got {vocab_size}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n_in, n_out = _lengths(rng, input_len, range_ratio), _lengths(rng, output_len, range_ratio)
        if vocab_size is None:
            prompt: str | list[int] = random_words(rng, n_in)
        else:
            prompt = [rng.randrange(TOKEN_ID_LOW, vocab_size) for _ in range(n_in)]
        requests.append(BenchRequest(prompt_len=n_in, output_len=n_out, prompt=prompt))
    return requests


def chat_requests(num_requests: int, system_len: int, user_len: int, output_len: int, *, seed: int = 0,
                  range_ratio: float = 0.0) -> list[BenchRequest]:
    """A synthetic chat set: every request shares one system prompt of `system_len` words (the
    prefix cache's best case) and asks a different random user message of about `user_len` words."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + random_words(rng, max(0, system_len - 5))
    requests = []
    for _ in range(num_requests):
        n_user, n_out = _lengths(rng, user_len, range_ratio), _lengths(rng, output_len, range_ratio)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": random_words(rng, n_user)}]
        requests.append(BenchRequest(prompt_len=system_len + n_user, output_len=n_out, messages=messages))
    return requests


def estimate_tokens(text: str) -> int:
    """A tokenizer-free token count estimate: about 4 characters per token, at least 1."""
    return max(1, round(len(text) / 4))


def prefix_repetition_requests(num_requests: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, *, seed: int = 0) -> list[BenchRequest]:
    """vLLM's prefix_repetition dataset: `num_prefixes` random prefixes of `prefix_len` words, each request one of
    them (in turn) followed by its own random suffix of `suffix_len` words: the prefix cache's steady state."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 1:
        raise ValueError(f"need num_prefixes >= 1, prefix_len >= 0, suffix_len >= 1; got {num_prefixes}, "
                         f"{prefix_len}, {suffix_len}")
    rng = random.Random(seed)
    prefixes = [random_words(rng, prefix_len) for _ in range(num_prefixes)]
    return [BenchRequest(prompt_len=prefix_len + suffix_len, output_len=output_len,
                         prompt=f"{prefixes[i % num_prefixes]} {random_words(rng, suffix_len)}")
            for i in range(num_requests)]


def load_custom(path: str | Path, num_requests: int, output_len: int, *, seed: int = 0,
                count_tokens: Callable[[str], int] = estimate_tokens) -> list[BenchRequest]:
    """vLLM's custom dataset: a JSONL file, one {"prompt": "...", "output_tokens": N} per line (output_tokens
    optional: `output_len` otherwise), shuffled with `seed`; requests cycle through the file when it is shorter."""
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path}:{number}: each line is {{\"prompt\": \"...\", \"output_tokens\": N}}")
        rows.append((row["prompt"], int(row.get("output_tokens") or output_len)))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    random.Random(seed).shuffle(rows)
    return [BenchRequest(prompt_len=count_tokens(prompt), output_len=max(1, out), prompt=prompt)
            for prompt, out in (rows[i % len(rows)] for i in range(num_requests))]


def load_sharegpt(path: str | Path, num_requests: int, *, seed: int = 0,
                  count_tokens: Callable[[str], int] = estimate_tokens, output_len: int | None = None,
                  min_len: int = 4, max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[BenchRequest]:
    """Requests from a ShareGPT-format JSON file (a list of {"conversations": [{"from", "value"}, ...]}).

    As in vLLM's sharegpt dataset: conversations with at least two turns, shuffled with `seed`; the
    first turn is the prompt, the second turn's token count is the output length (or `output_len`
    when given); pairs shorter than `min_len` or longer than the limits are skipped. Raises
    ValueError when the file is not of that shape or too few pairs qualify.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations, got {type(data).__name__}")
    pairs = [pair for entry in data if (pair := _first_pair(entry)) is not None]
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        n_in = count_tokens(prompt)
        n_out = output_len if output_len is not None else count_tokens(reply)
        if n_in < min_len or (output_len is None and n_out < min_len):
            continue
        if n_in > max_prompt_len or n_in + n_out > max_total_len:
            continue
        requests.append(BenchRequest(prompt_len=n_in, output_len=n_out, prompt=prompt))
        if len(requests) == num_requests:
            return requests
    raise ValueError(f"{path}: only {len(requests)} of {len(pairs)} conversations qualify, {num_requests} wanted")


def _first_pair(entry: Any) -> tuple[str, str] | None:
    """(first turn, second turn) of one conversation, or None when it has fewer than two text turns."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, Sequence) or len(turns) < 2:
        return None
    values = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
    if not all(isinstance(v, str) for v in values):
        return None
    return values[0], values[1]
