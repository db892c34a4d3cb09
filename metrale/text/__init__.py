"""The text front-end: tokens in, text out. Never imports mlx.

    tokenizer.py      Tokenizer: encode/decode over HF `tokenizers`, bos / eos ids, chat template
    gguf_vocab.py     the `tokenizers` pipeline a GGUF file's vocabulary metadata describes
    gguf_pretokenizers.py   llama.cpp's BPE pre-tokenizer regexes by `tokenizer.ggml.pre`
    gguf_sentencepiece.py   SentencePiece BPE ("llama") and Gemma 4's BPE ("gemma4")
    gguf_wordpiece.py       BERT's WordPiece ("bert") with llama.cpp's normalisation
    gguf_special_tokens.py  the tokens llama.cpp matches whole in the text (types corrected by text)
    chat_template.py  ChatTemplate: the model's jinja template in a sandbox, built-in fallbacks
    detokenizer.py    IncrementalDetokenizer: new ids -> new text, never broken UTF-8
    stop.py           StopStringMatcher: stop strings across token boundaries, ambiguous tail held back
    processor.py      InputProcessor (prompt/messages -> validated ids) and OutputProcessor (ids -> deltas)
"""
