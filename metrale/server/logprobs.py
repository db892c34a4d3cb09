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


def render(engine: EngineClient, logprobs: Sequence[TokenLogprob], chat: bool, top_n: int) -> dict[str, Any]:
    """One choice's `logprobs` object for these tokens; `top_n` alternatives per token at most."""
    ids = {item.token_id for item in logprobs} | {tid for item in logprobs for tid, _ in item.top[:top_n]}
    texts = dict(zip(ids, engine.token_texts(list(ids))))

    def text(token_id: int) -> str:
        return texts[token_id]

    if chat:
        return {"content": [
            {**_chat_entry(text(item.token_id), item.logprob),
             "top_logprobs": [_chat_entry(text(tid), value) for tid, value in item.top[:top_n]]}
            for item in logprobs]}
    tokens = [text(item.token_id) for item in logprobs]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob for item in logprobs],
        "top_logprobs": [{text(tid): value for tid, value in item.top[:top_n]} for item in logprobs]
        if top_n > 0 else None,
        "text_offset": offsets,
    }


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
