"""The validator's text codec: the piece-table decode equals the tokenizer's own."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel

from node.validator.policy import HFTextCodec, PieceTable, _piece_table


def test_piece_table_decodes_as_the_tokenizer_does(codec: HFTextCodec) -> None:
    backend = codec._backend
    assert codec._pieces is not None  # the tiny model's character tokenizer qualifies
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, codec.vocab_size, n).astype(np.uint32) for n in (0, 1, 7, 300, 1024)]
    seqs.append(np.arange(codec.vocab_size, dtype=np.uint32))  # every special token too
    expected = [backend.decode(s.tolist(), skip_special_tokens=True) for s in seqs]
    assert codec.decode_batch(seqs) == expected
    assert codec.decode_batch([s.tolist() for s in seqs]) == expected
    assert [codec.decode(s.tolist()) for s in seqs] == expected


def test_ids_outside_the_table_go_to_the_tokenizer(codec: HFTextCodec) -> None:
    outside = [5, 6, codec.vocab_size + 3]
    assert codec.decode_batch([outside]) == [codec._backend.decode(outside, skip_special_tokens=True)]


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
