"""The two GGUF vocabularies that spell spaces "▁" and fall back to <0xXX> byte tokens.

- "llama", SentencePiece BPE (Llama 2, Mistral, Phi-3, Gemma 1-3): merges recovered from the token
  scores (the highest-scoring merged piece first, as SentencePiece merges). Like llama.cpp, a space
  is prefixed to the text and again after every special token (`tokenizer.ggml.add_space_prefix`,
  default on).
- "gemma4", SentencePiece-style BPE over the stored merges (Gemma 4): spaces become "▁", the text
  is split only into runs of newlines and runs of anything else (llama.cpp's GEMMA4 pre-tokenizer),
  merges run on raw UTF-8 characters, unknown characters fall back to their bytes.

Never imports mlx.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["gemma4_bpe", "merges_from_scores", "parse_merges", "sentencepiece_bpe"]


def plain(value: Any) -> Any:
    """A GGUF metadata value as plain Python (mx.array scalars and vectors included)."""
    return value.tolist() if hasattr(value, "tolist") else value


def parse_merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` as (left, right) pairs, cut at the first space after the first
    character as llama.cpp does (so a left piece may itself be a space)."""
    if "tokenizer.ggml.merges" not in metadata:
        raise ValueError("GGUF metadata lacks 'tokenizer.ggml.merges', needed to build the tokenizer")
    pairs = []
    for merge in metadata["tokenizer.ggml.merges"]:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ValueError(f"GGUF merge {merge!r} has no space between its two pieces")
        pairs.append((merge[:cut], merge[cut + 1:]))
    return pairs


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as ranked merges: every split (left, right) of a piece into two pieces of the
    vocab, ranked by the merged piece's score, best first (ties: longer left, then longer right)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((score, len(left), len(right), left, right))
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def _spaces_as_pieces() -> decoders.Decoder:
    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])


def sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], unk: int | None) -> HFTokenizer:
    """The "llama" vocabulary: SentencePiece BPE with byte fallback."""
    if "tokenizer.ggml.scores" not in metadata:
        raise ValueError("GGUF metadata lacks 'tokenizer.ggml.scores', needed to build the tokenizer")
    scores = plain(metadata["tokenizer.ggml.scores"])
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_token = tokens[unk] if unk is not None else None
    bpe = models.BPE(
        vocab=vocab, merges=merges_from_scores(tokens, scores), unk_token=unk_token, fuse_unk=True, byte_fallback=True
    )
    backend = HFTokenizer(bpe)
    # Normalizers run on each stretch of text between added tokens: the prefix lands after every
    # special token too, as llama.cpp's "add space prefix if the previous fragment was special".
    steps = [normalizers.Replace(" ", "▁")]
    prefixed = bool(plain(metadata.get("tokenizer.ggml.add_space_prefix", True)))
    if prefixed:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence([_spaces_as_pieces(), decoders.Strip(" ", 1 if prefixed else 0, 0)])
    return backend


def gemma4_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> HFTokenizer:
    """The "gemma4" vocabulary: BPE over the stored merges on "▁"-spelled text, byte fallback."""
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=parse_merges(metadata), fuse_unk=False, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = _spaces_as_pieces()
    return backend
