"""GGUF merges as llama.cpp reads them, and the gemma4 SentencePiece-style BPE."""

from __future__ import annotations

import pytest

from metrale.text.gguf_sentencepiece import gemma4_bpe, merges_from_scores, parse_merges


def test_merges_cut_at_the_first_space_after_the_first_character():
    merges = parse_merges({"tokenizer.ggml.merges": ["a b", "  x", "ab c d"]})
    assert merges == [("a", "b"), (" ", "x"), ("ab", "c d")]
    with pytest.raises(ValueError, match="merge 'ab' has no space"):
        parse_merges({"tokenizer.ggml.merges": ["ab"]})
    with pytest.raises(ValueError, match="lacks 'tokenizer.ggml.merges'"):
        parse_merges({})


def test_merges_from_scores_rank_by_the_merged_piece():
    assert merges_from_scores(["a", "b", "c", "ab", "bc"], [0, 0, 0, -2.0, -1.0]) == [("b", "c"), ("a", "b")]


def test_gemma4_spells_spaces_splits_newlines_and_falls_back_to_bytes():
    tokens = ["<pad>", *[f"<0x{b:02X}>" for b in range(256)], "▁", "h", "i", "▁h", "▁hi", "\n", "\n\n"]
    merges = ["▁ h", "▁h i", "\n \n"]
    backend = gemma4_bpe({"tokenizer.ggml.merges": merges}, tokens)
    ids = backend.encode(" hi\n\n é").ids
    assert [tokens[i] for i in ids] == ["▁hi", "\n\n", "▁", "<0xC3>", "<0xA9>"]
    assert backend.decode(ids) == " hi\n\n é"
