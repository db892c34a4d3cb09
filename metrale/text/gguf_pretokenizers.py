"""llama.cpp's BPE pre-tokenizers, by the name a GGUF stores in `tokenizer.ggml.pre`.

llama.cpp (src/llama-vocab.cpp, `llm_tokenizer_bpe`) splits text before BPE with a list of regexes:
each one splits every piece the previous one left, and the text between its matches stays a piece
of its own. That is `tokenizers`' Split(pattern, "isolated") applied in sequence, so each family
here is the list of regexes llama.cpp runs (its "adapted" spellings, e.g. (?:'[sS]|...) for the
case-insensitive contractions), then the GPT-2 byte-to-unicode mapping.

Besides the regexes, a family says whether a whole pre-token found in the vocab is taken as one
token before any merge (llama.cpp's `ignore_merges`) and whether llama.cpp adds a bos by default.
Never imports mlx.
"""

from __future__ import annotations

import dataclasses

from tokenizers import Regex, pre_tokenizers

__all__ = ["GGUF_PRE_TOKENIZERS", "PreTokenizerRule", "pre_tokenizer_rule"]

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp writes "(?=[\p{L}])([^a-z])" for "an upper-case or caseless letter" (its \p{Lu} is any letter)
_UPPERISH, _LOWERISH = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LLM_LETTERS = (  # llama.cpp's literal ranges, escaped: an editor's NFC would change some ends
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
# llama.cpp matches these regexes (no \p{..}) after turning every non-ASCII space into "\v", so a
# space inside a literal range (U+3000, U+1680, U+2000-U+200A, ...) never matches it: left out here.
_DEEPSEEK_LLM_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3001-\u3002]+"
_CJK_HANGUL = (
    "[\u4e00-\u9fa5\u0800-\u167f\u1681-\u1fff\u200b-\u2027\u202a-\u202e\u2030-\u205e\u2060-\u2fff"
    "\u3001-\u4e00\uac00-\ud7ff]+"
)
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_DEEPSEEK3_MAIN = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class PreTokenizerRule:
    """How llama.cpp splits text before BPE for one family of `tokenizer.ggml.pre` names.

    regexes: applied in order, each splitting the pieces the previous one left ("isolated").
    ignore_merges: a pre-token that is itself in the vocab is one token, whatever the merges say.
    add_bos: llama.cpp's default when the GGUF has no `tokenizer.ggml.add_bos_token`.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False

    def __post_init__(self) -> None:
        if not self.regexes:
            raise ValueError("a pre-tokenizer rule needs at least one regex")

    def build(self, unspellable: str = "") -> pre_tokenizers.PreTokenizer:
        """The `tokenizers` pre-tokenizer: the regex splits, then GPT-2's byte-to-unicode mapping.

        unspellable: byte-level characters the vocab lacks. llama.cpp merges around such a character
        and drops it at the end; `tokenizers` drops it first and merges its neighbours together. Each
        becomes a pre-token of its own here, so the merges stop at it as llama.cpp's do."""
        steps = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in self.regexes]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
        if unspellable:
            alone = "".join(f"\\x{{{ord(c):x}}}" for c in sorted(unspellable))
            steps.append(pre_tokenizers.Split(Regex(f"[{alone}]"), behavior="isolated"))
        return pre_tokenizers.Sequence(steps)


_DEFAULT = PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_RULE = PreTokenizerRule((_GPT2,))
_DIGITS_THEN_GPT2 = PreTokenizerRule((r"\p{N}", _GPT2))
_LLAMA3_RULE = PreTokenizerRule((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_RULE = PreTokenizerRule((_QWEN2,))

# Families as llama.cpp's llama_vocab::impl::load groups the names (LLAMA_VOCAB_PRE_TYPE_*).
_FAMILIES: tuple[tuple[PreTokenizerRule, tuple[str, ...]], ...] = (
    (_DEFAULT, ("default",)),
    (_GPT2_RULE, (
        "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
        "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "jina-v1-en", "jina-v2-code",
        "roberta-bpe",
    )),
    (_DIGITS_THEN_GPT2, ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2")),
    (_LLAMA3_RULE, ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")),
    (PreTokenizerRule((_LLAMA3,)), ("dbrx", "smaug-bpe", "chatglm-bpe")),
    (PreTokenizerRule((_LLAMA3,), ignore_merges=True), ("glm4", "glm5")),
    (_QWEN2_RULE, (
        "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan", "solar-open", "grok-2",
    )),
    (PreTokenizerRule((_QWEN35,)), ("qwen35",)),
    (PreTokenizerRule(
        (r"[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCT, r"\s+$", _CJK_HANGUL, r"\p{N}+")
    ), ("deepseek-llm",)),
    (PreTokenizerRule((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")), ("deepseek-coder",)),
    (PreTokenizerRule((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_MAIN)), (
        "deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4",
    )),
    (PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")), ("falcon",)),
    (PreTokenizerRule((_BLOOM,)), ("poro-chat", "bloom", "gpt3-finnish")),
    (PreTokenizerRule((_BLOOM, r"\p{N}")), ("viking",)),
    (PreTokenizerRule((_TEKKEN,), ignore_merges=True, add_bos=True), ("tekken",)),
    (PreTokenizerRule((_GPT4O,)), ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")),
    (PreTokenizerRule((
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    )), ("bailingmoe", "bailingmoe2", "llada-moe")),
    (PreTokenizerRule((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    )), ("seed-coder",)),
)
GGUF_PRE_TOKENIZERS: dict[str, PreTokenizerRule] = {name: rule for rule, names in _FAMILIES for name in names}


def pre_tokenizer_rule(name: str | None) -> PreTokenizerRule:
    """The rule for a `tokenizer.ggml.pre` value (None: llama.cpp's "default"); ValueError listing the
    supported names otherwise."""
    rule = GGUF_PRE_TOKENIZERS.get("default" if name is None else name)
    if rule is None:
        raise ValueError(
            f"GGUF pre-tokenizer {name!r} is not supported; supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}"
        )
    return rule
