"""The validator's text codec: the piece-table decode equals the tokenizer's own, and the
decode-only codec handed to precheck workers decodes as the full one does."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel

from node.validator.decoding import PieceTable, TokenizerDecoder, _piece_table
from node.validator.policy import HFTextCodec


def test_piece_table_decodes_as_the_tokenizer_does(codec: HFTextCodec) -> None:
    backend = codec._tok.backend_tokenizer
    assert (
        codec._decoder is not None and codec._decoder._pieces is not None
    )  # a character tokenizer
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, codec.vocab_size, n).astype(np.uint32) for n in (0, 1, 7, 300, 1024)]
    seqs.append(np.arange(codec.vocab_size, dtype=np.uint32))  # every special token too
    expected = [backend.decode(s.tolist(), skip_special_tokens=True) for s in seqs]
    assert codec.decode_batch(seqs) == expected
    assert codec.decode_batch([s.tolist() for s in seqs]) == expected
    assert [codec.decode(s.tolist()) for s in seqs] == expected


def test_ids_outside_the_table_go_to_the_tokenizer(codec: HFTextCodec) -> None:
    outside = [5, 6, codec.vocab_size + 3]
    backend = codec._tok.backend_tokenizer
    assert codec.decode_batch([outside]) == [backend.decode(outside, skip_special_tokens=True)]


def test_only_concatenating_decoders_get_a_table() -> None:
    vocab = {"a": 0, "b": 1, "<unk>": 2}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    assert _piece_table(tok, 3) is None  # no decoder: tokens are joined with spaces
    tok.decoder = decoders.Fuse()
    table = _piece_table(tok, 3)
    assert table is not None and table.pieces == ["a", "b", "<unk>"]
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    assert _piece_table(tok, 3) is None


def test_pieces_of_any_utf8_width_join_as_their_texts() -> None:
    pieces = ["", "a", "é", "日本", "🙂", "xyz"]
    table = PieceTable(pieces)
    rng = np.random.default_rng(1)
    for n in (0, 1, 5, 200):
        ids = rng.integers(0, len(pieces), n)
        assert table.decode(ids) == "".join(pieces[i] for i in ids)
    assert PieceTable([""]).decode(np.zeros(3, dtype=np.int64)) == ""


def test_one_byte_pieces_join_as_their_texts_too() -> None:
    rng = np.random.default_rng(3)
    for pieces in (
        ["", "a", "b", "\n", ""],
        ["", "a", "\x00", "b"],
    ):  # a NUL piece: the general path
        table = PieceTable(pieces)
        assert (table._single is not None) == ("\x00" not in pieces)
        for dtype in (np.uint32, np.int64):
            ids = rng.integers(0, len(pieces), 300).astype(dtype)
            assert table.decode(ids) == "".join(pieces[i] for i in ids)


def test_the_decoder_for_workers_decodes_as_the_codec_and_needs_no_transformers(
    codec: HFTextCodec,
) -> None:
    decoder = codec.decoder()
    assert isinstance(decoder, TokenizerDecoder)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, codec.vocab_size, n).astype(np.uint32) for n in (0, 3, 500)]
    seqs += [np.arange(codec.vocab_size, dtype=np.uint32), np.array([1, 2, codec.vocab_size + 5])]
    expected = codec.decode_batch(seqs)
    again = pickle.loads(pickle.dumps(decoder))
    assert again.decode_batch(seqs) == expected
    assert [again.decode(s.tolist()) for s in seqs] == [codec.decode(s.tolist()) for s in seqs]
    # a fresh interpreter decodes it with the tokenizers library alone
    probe = (
        "import pickle, sys; d = pickle.loads(sys.stdin.buffer.read()); "
        "print(repr(d.decode([5, 6, 7])), 'transformers' in sys.modules, 'torch' in sys.modules, sep='|')"
    )
    out = (
        subprocess.run(
            [sys.executable, "-c", probe],
            input=pickle.dumps(decoder),
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .strip()
        .split("|")
    )
    assert out == [repr(codec.decode([5, 6, 7])), "False", "False"]
