"""A character-level tokenizer built with ``tokenizers`` and saved as a standard HF tokenizer.

One token per printable ASCII character plus newline and tab, and four
specials: ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2), ``<unk>`` (3). Encoding
prepends ``<bos>``; decoding concatenates characters without spaces. The
saved directory loads with ``AutoTokenizer.from_pretrained``; the ids are a
pure function of this module, so two builds produce identical files.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
CHARS = "".join(sorted(set(string.printable) - set("\r\x0b\x0c")))


def build_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    return vocab


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = build_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token, newline included.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
