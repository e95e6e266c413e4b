"""A document far longer than a tokenizer's comfortable batch (a whole book, a dump in one .txt file) is encoded in
pieces cut at newlines: the same tokens as encoding it whole, where the tokenizer allows it."""

import random

import numpy as np

from hmscale.data.packing import _cut_points, _encode_in_pieces, tokenize_documents
from hmscale.data.tokenizer import train_bpe


def _docs(n_docs=4, words=2500, seed=0):
    rng = random.Random(seed)
    vocab = ["alpha", "Beta", "gamma.", "δelta", "12", "(x)", "  ", "\t", "..", "::", "é", "\u0301"]
    seps = [" ", "\n", "\n\n", " \n", "\n ", "", "\r\n"]
    return ["".join(rng.choice(vocab) + rng.choice(seps) for _ in range(words)) for _ in range(n_docs)]


def test_long_documents_in_pieces_give_the_whole_documents_tokens():
    docs = _docs()
    tok = train_bpe(docs, 400)
    whole, lens = tokenize_documents(tok, docs, tok.eos_token_id)
    cut, cut_lens = tokenize_documents(tok, docs, tok.eos_token_id, piece_chars=150)
    assert sum(len(list(_cut_points(d, 150))) for d in docs) > 100  # it was really cut
    assert np.array_equal(whole, cut) and np.array_equal(lens, cut_lens)


def test_cut_points_lie_after_a_newline_between_two_non_spaces():
    text = _docs(1, 3000, seed=3)[0]
    cuts = list(_cut_points(text, 100))
    assert cuts == sorted(cuts) and len(cuts) > 10
    for i in cuts:
        assert text[i - 1] == "\n" and not text[i - 2].isspace() and not text[i].isspace()
    assert list(_cut_points("short\ntext", 100)) == []


def test_a_tokenizer_that_marks_a_texts_start_encodes_documents_whole():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    docs = _docs(2, 400, seed=5)
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")  # "▁" before every text's start
    raw.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")
    enc = lambda texts: [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)]  # noqa: E731
    assert not _encode_in_pieces(enc)
    whole, _ = tokenize_documents(tok, docs, tok.eos_token_id)
    cut, _ = tokenize_documents(tok, docs, tok.eos_token_id, piece_chars=100)
    assert np.array_equal(whole, cut)
