"""The HF `tokenizers` pipeline that a GGUF file's tokenizer metadata describes.

A GGUF has no tokenizer.json: it stores llama.cpp's description (tokenizer.ggml.model, pre,
tokens, merges or scores, token_type, special ids). Each vocabulary type llama.cpp knows is
rebuilt to tokenize exactly as llama.cpp does (checked against llama.cpp's own test vectors):

- "gpt2", byte-level BPE (SmolLM2, Llama 3, Qwen, DeepSeek, Falcon, Command-R, ...): BPE over the
  stored vocab and merges, after the pre-tokenizer llama.cpp names by `tokenizer.ggml.pre`
  (`metrale.text.gguf_pretokenizers`), the ByteLevel decoder.
- "llama" (SentencePiece BPE) and "gemma4" (SentencePiece-style BPE): `metrale.text.gguf_sentencepiece`.
- "bert" (WordPiece): `metrale.text.gguf_wordpiece`.

In all, the tokens llama.cpp matches whole in the text (`metrale.text.gguf_special_tokens`) become
added tokens, so "<|im_start|>" stays one id. A bos (and for "bert" a closing [SEP]) is added
where llama.cpp adds one: its default for the vocabulary type, unless the file's
`tokenizer.ggml.add_bos_token` says otherwise. Never imports mlx: GGUF scalars read by `mx.load`
are taken through their `.item()` / `.tolist()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from metrale.text.gguf_pretokenizers import pre_tokenizer_rule
from metrale.text.gguf_sentencepiece import gemma4_bpe, parse_merges, plain, sentencepiece_bpe
from metrale.text.gguf_special_tokens import gguf_added_tokens
from metrale.text.gguf_wordpiece import wordpiece

__all__ = ["GGUF_TOKENIZER_MODELS", "GGUFTokenizerSpec", "gguf_tokenizer_spec"]

# tokenizer.ggml.model -> what it is, for the error that lists them
GGUF_TOKENIZER_MODELS = {
    "gpt2": "byte-level BPE", "llama": "SentencePiece BPE", "gemma4": "SentencePiece-style BPE", "bert": "WordPiece",
}


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerSpec:
    """The backend pipeline and the special-token facts the file states (eos, eot, eom ids in order)."""

    backend: HFTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_template: str | None


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> HFTokenizer:
    rule = pre_tokenizer_rule(metadata.get("tokenizer.ggml.pre"))
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=parse_merges(metadata), fuse_unk=False, ignore_merges=rule.ignore_merges)
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = rule.build("".join(c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab))
    backend.decoder = decoders.ByteLevel()
    return backend


def _backend(kind: str, metadata: Mapping[str, Any], tokens: list[str], unk: int | None) -> tuple[HFTokenizer, bool]:
    """The pipeline of vocabulary type `kind` and whether llama.cpp adds a bos by default."""
    if kind == "gpt2":
        return _byte_level_bpe(metadata, tokens), pre_tokenizer_rule(metadata.get("tokenizer.ggml.pre")).add_bos
    if kind == "llama":
        return sentencepiece_bpe(metadata, tokens, unk), True
    if kind == "gemma4":
        return gemma4_bpe(metadata, tokens), True
    return wordpiece(metadata, tokens, unk), True


def gguf_tokenizer_spec(metadata: Mapping[str, Any]) -> GGUFTokenizerSpec:
    """Build the tokenizer a GGUF describes; ValueError naming what is unsupported or missing."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in GGUF_TOKENIZER_MODELS:
        supported = ", ".join(f"{name!r} ({what})" for name, what in GGUF_TOKENIZER_MODELS.items())
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: {supported}")
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError("GGUF metadata lacks 'tokenizer.ggml.tokens', needed to build the tokenizer")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types = plain(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))

    def token_id(*keys: str) -> int | None:
        values = [metadata.get(f"tokenizer.ggml.{key}") for key in keys]
        value = next((v for v in values if v is not None), None)
        if value is None:
            return None
        index = int(plain(value))
        if not 0 <= index < len(tokens):
            name = keys[0].removesuffix("_id").replace("_", " ")
            raise ValueError(f"GGUF {name} id {index} out of range for a vocabulary of {len(tokens)} tokens")
        return index

    backend, add_bos_default = _backend(kind, metadata, tokens, token_id("unknown_token_id"))
    special, plain_tokens = gguf_added_tokens(tokens, token_types, metadata)
    backend.add_special_tokens(special)
    backend.add_tokens(plain_tokens)
    bos = token_id("bos_token_id", "cls_token_id")  # llama.cpp reads a BERT's [CLS] as its bos
    eos = [i for i in (token_id(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")) if i is not None]
    add_bos = bool(plain(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))) or kind == "gemma4"
    add_eos = bool(plain(metadata.get("tokenizer.ggml.add_eos_token", False)))
    add_sep = bool(plain(metadata.get("tokenizer.ggml.add_sep_token", kind == "bert")))
    tail = [eos[0]] if add_eos and eos else []
    sep = token_id("seperator_token_id")  # llama.cpp's spelling of the key
    tail += [sep] if add_sep and sep is not None else []
    _set_post_processor(backend, [bos] if add_bos and bos is not None else [], tail)
    return GGUFTokenizerSpec(
        backend=backend, bos_token_id=bos, eos_token_ids=tuple(eos),
        pad_token_id=token_id("padding_token_id"), chat_template=metadata.get("tokenizer.chat_template"),
    )


def _set_post_processor(backend: HFTokenizer, head: Sequence[int], tail: Sequence[int]) -> None:
    """Wrap encodings in the ids llama.cpp adds around a text (bos; eos or [SEP])."""
    if not head and not tail:
        return
    head_tokens = [backend.id_to_token(i) for i in head]
    tail_tokens = [backend.id_to_token(i) for i in tail]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(head_tokens + ["$A"] + tail_tokens),
        pair=" ".join(head_tokens + ["$A"] + tail_tokens + head_tokens + ["$B:1"] + tail_tokens),
        special_tokens=list(dict.fromkeys((backend.id_to_token(i), i) for i in [*head, *tail])),
    )
