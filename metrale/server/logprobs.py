"""Render the engine's `TokenLogprob`s in OpenAI's two logprobs formats.

    completions: {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}] | None,
                  "text_offset": [int]}
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

Token strings are each token decoded alone, so a token holding part of a UTF-8 character renders
as U+FFFD here (its `bytes` are of that rendering); the streamed text itself is never split so.
"""

from __future__ import annotations

from typing import Any, Sequence

from metrale.engine.protocol import EngineClient
from metrale.outputs import TokenLogprob


def render(engine: EngineClient, logprobs: Sequence[TokenLogprob], chat: bool, top_n: int, *,
           leading_token_id: int | None = None) -> dict[str, Any]:
    """One choice's `logprobs` object for these tokens; `top_n` alternatives per token at most.
    `leading_token_id` (completions with echo: the prompt's first token, which has no logprob) comes
    first, with null logprob and top_logprobs."""
    ids = {item.token_id for item in logprobs} | {tid for item in logprobs for tid, _ in item.top[:top_n]}
    if leading_token_id is not None:
        ids.add(leading_token_id)
    texts = dict(zip(ids, engine.token_texts(list(ids))))

    def text(token_id: int) -> str:
        return texts[token_id]

    if chat:
        return {"content": [
            {**_chat_entry(text(item.token_id), item.logprob),
             "top_logprobs": [_chat_entry(text(tid), value) for tid, value in item.top[:top_n]]}
            for item in logprobs]}
    lead = [] if leading_token_id is None else [text(leading_token_id)]
    tokens = lead + [text(item.token_id) for item in logprobs]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None] * len(lead) + [item.logprob for item in logprobs],
        "top_logprobs": [None] * len(lead) + [{text(tid): value for tid, value in item.top[:top_n]}
                                              for item in logprobs] if top_n > 0 else None,
        "text_offset": offsets,
    }


def render_prompt(engine: EngineClient, logprobs: Sequence[TokenLogprob | None] | None,
                  top_n: int) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {"logprob", "rank",
    "decoded_token"}} holding the prompt token and its `top_n` most likely alternatives."""
    if logprobs is None:
        return None
    ids = {tid for item in logprobs if item is not None for tid in (item.token_id, *(t for t, _ in item.top[:top_n]))}
    texts = dict(zip(ids, engine.token_texts(list(ids))))
    out: list[dict[str, Any] | None] = []
    for item in logprobs:
        if item is None:
            out.append(None)
            continue
        entry = {str(tid): {"logprob": value, "rank": rank, "decoded_token": texts[tid]}
                 for rank, (tid, value) in enumerate(item.top[:top_n], start=1)}
        entry[str(item.token_id)] = {"logprob": item.logprob, "rank": item.rank, "decoded_token": texts[item.token_id]}
        out.append(entry)
    return out


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
