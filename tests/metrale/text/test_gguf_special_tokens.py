"""Which GGUF tokens are matched whole in the text, after llama.cpp's corrections by token text."""

from __future__ import annotations

from metrale.text.gguf_special_tokens import CONTROL, USER_DEFINED, gguf_added_tokens

NORMAL, UNKNOWN = 1, 2


def added(tokens, types, **metadata):
    special, plain = gguf_added_tokens(tokens, types, metadata)
    return {t.content: t for t in special}, {t.content: t for t in plain}


def test_types_from_the_file():
    special, plain = added(["<unk>", "<s>", "a", "<tool>"], [UNKNOWN, CONTROL, NORMAL, USER_DEFINED])
    assert sorted(special) == ["<s>", "<unk>"] and list(plain) == ["<tool>"]
    assert all(t.special for t in special.values()) and not plain["<tool>"].special
    assert not any(t.normalized or t.lstrip or t.rstrip for t in [*special.values(), *plain.values()])


def test_end_of_generation_and_fim_texts_become_control():
    tokens = ["</s>", "<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "hello"]
    special, _ = added(tokens, [NORMAL] * 5)
    assert sorted(special) == ["</s>", "<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>"]
    # a fim key in the file names the token itself: llama.cpp does not search by text then
    special, _ = added(tokens, [NORMAL] * 5, **{"tokenizer.ggml.fim_pre_token_id": 2})
    assert "<|fim_prefix|>" not in special and "<|fim_suffix|>" in special


def test_gemma4_keeps_a_normal_eos_text_and_gpt_oss_markers_are_user_defined():
    special, _ = added(["</s>", "<|tool_response>"], [NORMAL, USER_DEFINED])
    assert "</s>" not in special
    special, plain = added(["<|channel|>", "<|message|>"], [CONTROL, CONTROL])
    assert not special and sorted(plain) == ["<|channel|>", "<|message|>"]


def test_phi3_specials_strip_whitespace_to_their_right():
    tokens = ["<unk>", "<s>", "</s>", "<|end|>", "<|user|>"]
    special, _ = added(tokens, [UNKNOWN, CONTROL, CONTROL, CONTROL, CONTROL], **{"general.name": "Phi3"})
    assert {t: special[t].rstrip for t in tokens} == {
        "<unk>": False, "<s>": False, "</s>": True, "<|end|>": True, "<|user|>": True,
    }


def test_bert_like_masks_strip_whitespace_to_their_left():
    special, _ = added(["<mask>"], [CONTROL], **{"general.architecture": "nomic-bert-moe"})
    assert special["<mask>"].lstrip and not special["<mask>"].rstrip
    special, _ = added(["<mask>"], [CONTROL], **{"general.architecture": "llama"})
    assert not special["<mask>"].lstrip
