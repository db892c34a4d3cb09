"""Text <-> token ids over Hugging Face `tokenizers`, built from GGUF metadata or a tokenizer.json.

`Tokenizer` wraps the backend with what the engine needs besides encode/decode: the bos id, the
eos ids (the file's eos plus the end-of-turn token its chat template uses, e.g. <|im_end|>), the
chat template and the special tokens. The GGUF pipelines themselves are built in
`metrale.text.gguf_vocab`. This module never imports mlx.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from metrale.text.gguf_vocab import gguf_tokenizer_spec

__all__ = ["Tokenizer", "END_OF_TURN_TOKENS"]

# Tokens that end an assistant turn in common chat formats; one counts as an eos id when the
# model's own chat template uses it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


class Tokenizer:
    """Encode/decode plus the special-token facts the engine needs (bos, eos ids, chat template).

    Build it with `from_gguf_metadata`, `from_file` (a tokenizer.json) or `from_folder`.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.pad_token_id = pad_token_id
        size = self.vocab_size
        for name, ids in (
            ("bos_token_id", [bos_token_id]), ("eos_token_ids", self.eos_token_ids), ("pad_token_id", [pad_token_id])
        ):
            bad = [i for i in ids if i is not None and not 0 <= i < size]
            if bad:
                raise ValueError(f"{name} {bad} out of range for a vocabulary of {size} tokens")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF file describes, tokenizing as llama.cpp does: byte-level BPE ("gpt2"),
        SentencePiece BPE ("llama"), Gemma 4's BPE ("gemma4") or WordPiece ("bert")."""
        spec = gguf_tokenizer_spec(metadata)
        eos = list(spec.eos_token_ids) + _end_of_turn_ids(spec.chat_template, spec.backend.get_vocab())
        return cls(
            spec.backend, bos_token_id=spec.bos_token_id, eos_token_ids=eos,
            chat_template=spec.chat_template, pad_token_id=spec.pad_token_id,
        )

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        tokenizer_config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
    ) -> Tokenizer:
        """From a tokenizer.json, with the special tokens and chat template of tokenizer_config.json
        and the eos ids of generation_config.json when given."""
        backend = HFTokenizer.from_file(str(path))
        config = dict(tokenizer_config or {})

        def special_id(key: str) -> int | None:
            token = config.get(key)
            if isinstance(token, Mapping):
                token = token.get("content")
            return None if token is None else backend.token_to_id(token)

        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        eos = [special_id("eos_token")]
        gen_eos = (generation_config or {}).get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eos = [i for i in eos if i is not None] + _end_of_turn_ids(template, backend.get_vocab())
        return cls(
            backend, bos_token_id=special_id("bos_token"), eos_token_ids=eos,
            chat_template=template, pad_token_id=special_id("pad_token"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """From a model folder: tokenizer.json plus tokenizer_config.json, generation_config.json and
        chat_template.jinja (or chat_template.json), which take precedence over tokenizer_config's
        template, where present."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")

        def read_json(name: str) -> dict[str, Any]:
            file = folder / name
            return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}

        config = read_json("tokenizer_config.json")
        jinja = folder / "chat_template.jinja"  # a standalone template wins, as in transformers
        if jinja.is_file():
            config["chat_template"] = jinja.read_text(encoding="utf-8")
        elif "chat_template" in read_json("chat_template.json"):
            config["chat_template"] = read_json("chat_template.json")["chat_template"]  # multimodal processors
        return cls.from_file(
            folder / "tokenizer.json", tokenizer_config=config, generation_config=read_json("generation_config.json")
        )

    # -- the API ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        """The bos token's text, or None."""
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_tokens(self) -> tuple[str, ...]:
        """The texts of `eos_token_ids`, in the same order."""
        return tuple(self.convert_ids_to_tokens(self.eos_token_ids))

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Every special (control) token's text, by id."""
        added = self.backend.get_added_tokens_decoder()  # {id: AddedToken}
        return tuple(added[i].content for i in sorted(added) if added[i].special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token texts in it become their single ids.

        `add_special_tokens` adds what the model's tokenizer adds around a text (a bos where the
        model asks for one; nothing for SmolLM2)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (a broken UTF-8 tail decodes to U+FFFD; see the detokenizer)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level spelling), or None when out of range."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self.backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary entries of `ids`; ValueError on an id outside the vocabulary."""
        out = []
        for i in ids:
            token = self.backend.id_to_token(int(i))
            if token is None:
                raise ValueError(f"token id {i} out of range for a vocabulary of {self.vocab_size} tokens")
            out.append(token)
        return out

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_tokens!r})"


def _end_of_turn_ids(template: str | None, vocab: Mapping[str, int]) -> list[int]:
    """Ids of the END_OF_TURN_TOKENS that the chat template writes and the vocab holds."""
    if not template:
        return []
    return [vocab[t] for t in END_OF_TURN_TOKENS if t in template and t in vocab]
