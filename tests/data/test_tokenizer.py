"""The embedded byte-level BPE: trained once, cached on disk by (corpus listing, vocab size), eos id 0."""

from hmscale.data.sources import EmbeddedSource
from hmscale.data.tokenizer import tokenizer_fingerprint, trained_tokenizer


def test_bpe_is_cached_and_round_trips(tmp_path):
    source = EmbeddedSource(val_fraction=0.1, max_documents=25)
    logs = []
    tok = trained_tokenizer(source, 300, tmp_path, log=logs.append)
    assert any("training" in m for m in logs)
    entries = list((tmp_path / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").exists()
    assert len(tok) == 300 and tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    text = "def f(x):\n    return x ** 2  # café ✓\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < 300

    logs.clear()
    again = trained_tokenizer(source, 300, tmp_path, log=logs.append)
    assert any("cached" in m for m in logs) and not any("training" in m for m in logs)
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1

    # another vocab size or another file list is another cache entry
    other = trained_tokenizer(source, 280, tmp_path, log=logs.append)
    trained_tokenizer(EmbeddedSource(val_fraction=0.1, max_documents=24), 300, tmp_path, log=logs.append)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 3
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    assert not any(p.name.startswith(".") for p in (tmp_path / "tokenizers").iterdir())  # no temp leftovers


def test_a_tokenizer_that_cannot_load_is_a_one_line_value_error(tmp_path):
    """`hmscale prepare` reports ValueErrors in one line; an OSError from a bad tokenizer.name_or_path was a traceback."""
    import pytest

    from hmscale.data.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match="tokenizer.name_or_path: cannot load") as info:
        load_tokenizer(str(tmp_path / "no" / "such" / "tokenizer"))
    assert isinstance(info.value, OSError)  # still what callers catching transformers' error expect
