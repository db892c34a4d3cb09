"""Which GGUF tokens llama.cpp matches whole in the text, and how.

`tokenizer.ggml.token_type` says most of it: CONTROL (3) and UNKNOWN (2) tokens are special, USER_DEFINED
(4) ones are matched in any text. llama.cpp then corrects the file from the token texts
(llama_vocab::impl::load, "auto-detect special tokens by text"): end-of-generation and fill-in-the-middle
markers such as "<|endoftext|>", "<|im_end|>" or "</s>" become CONTROL even where the file says NORMAL,
gpt-oss's channel markers become USER_DEFINED, and by model name some tokens eat the whitespace beside
them (Phi-3's specials strip to their right, a BERT-like "<mask>" to its left). This module is that
table, so a GGUF tokenizes here as llama.cpp tokenizes it. Never imports mlx.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken

__all__ = ["gguf_added_tokens"]

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp token types (1 normal, 5 unused, 6 byte)

# Texts llama.cpp makes end-of-generation tokens, and so CONTROL.
_END_OF_GENERATION = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
# Fill-in-the-middle markers, by the GGUF key that, when present, names the token instead.
_FILL_IN_THE_MIDDLE = {
    "fim_pre_token_id": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                         "<|code_prefix|>", "<|prefix|>"),
    "fim_suf_token_id": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                         "<|code_suffix|>", "<|suffix|>"),
    "fim_mid_token_id": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                         "<|code_middle|>", "<|middle|>"),
    "fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_token_id": ("<|file_sep|>",),
}
_GPT_OSS_MARKERS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


def _corrected_types(tokens: Sequence[str], types: Sequence[int], metadata: Mapping[str, Any]) -> list[int]:
    """The token types after llama.cpp's corrections by text."""
    control_texts = set(_END_OF_GENERATION)
    for key, texts in _FILL_IN_THE_MIDDLE.items():
        if metadata.get(f"tokenizer.ggml.{key}") is None:
            control_texts.update(texts)
    # gemma4 and plamo keep a normal "</s>" (llama.cpp: "'</s>' is a normal token here")
    if "</s>" in tokens and ("<|tool_response>" in tokens or "<|plamo:eos|>" in tokens):
        control_texts.discard("</s>")
    corrected = list(types)
    for index, text in enumerate(tokens):
        if text in _GPT_OSS_MARKERS:
            corrected[index] = USER_DEFINED
        elif text in control_texts and corrected[index] != CONTROL:
            corrected[index] = CONTROL
    return corrected


def _strips(metadata: Mapping[str, Any]) -> tuple[frozenset[str], frozenset[str], bool]:
    """(texts that strip whitespace to their left, to their right, whether every special strips right)."""
    name = str(metadata.get("general.name", "")).lower()
    pre = str(metadata.get("tokenizer.ggml.pre", ""))
    arch = str(metadata.get("general.architecture", ""))
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        a in arch for a in ("nomic-bert-moe", "jina-bert-v3")
    ):
        return frozenset({"<mask>"}), frozenset(), False
    if "phi-3" in name or "phi3" in name:
        return frozenset(), frozenset({"</s>"}), True
    if "modern-bert" in name:
        return frozenset({"[MASK]"}), frozenset(), False
    return frozenset(), frozenset(), False


def gguf_added_tokens(
    tokens: Sequence[str], types: Sequence[int], metadata: Mapping[str, Any]
) -> tuple[list[AddedToken], list[AddedToken]]:
    """(special, plain) added tokens of a GGUF vocabulary, as llama.cpp partitions the text on them.

    Special: CONTROL and UNKNOWN tokens, matched in the text (and skipped by decode's
    skip_special_tokens). Plain: USER_DEFINED tokens, matched in any text, decoded as text."""
    corrected = _corrected_types(tokens, types, metadata)
    left, right, all_right = _strips(metadata)
    special, plain = [], []
    for text, kind in zip(tokens, corrected):
        if kind not in (UNKNOWN, CONTROL, USER_DEFINED):
            continue
        strips_right = text in right or (all_right and text not in ("<unk>", "<s>", "<|endoftext|>"))
        token = AddedToken(
            text, special=kind != USER_DEFINED, normalized=False, lstrip=text in left, rstrip=strips_right
        )
        (plain if kind == USER_DEFINED else special).append(token)
    return special, plain
