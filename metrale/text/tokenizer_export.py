"""A model's tokenizer as a Hugging Face tokenizer folder, for the tools that load one with `AutoTokenizer`
(guidellm, aiperf, vllm bench, inference-perf count tokens that way):

    tokenizer.json          the tokenizer metrale uses (for a GGUF, the one it builds from the file's vocabulary)
    tokenizer_config.json   PreTrainedTokenizerFast with the bos / eos / pad tokens, the chat template and
                            model_max_length
    special_tokens_map.json the same special tokens

`metrale tokenizer export DIR [--model M]` writes it (metrale.cli).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from metrale.text.tokenizer import Tokenizer


def export_tokenizer(tokenizer: Tokenizer, folder: str | Path, *, model_max_length: int | None = None) -> Path:
    """Write the folder (created if needed; its three files replaced); returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    special = _special_tokens(tokenizer)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              **special}
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")
    return folder


def _special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    named = {"bos_token": tokenizer.bos_token_id,
             "eos_token": tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None,
             "pad_token": tokenizer.pad_token_id}
    return {name: tokenizer.id_to_token(token_id) for name, token_id in named.items()
            if token_id is not None and tokenizer.id_to_token(token_id) is not None}
