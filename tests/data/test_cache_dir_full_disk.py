"""A full disk while the token stream is written: one line naming the cache file (and so the filesystem to free),
nothing torn, and the rerun finishes with the same stream as an uninterrupted run."""

import errno
import json

import pytest

from hmscale.atomic import storage_error_line
from hmscale.data import bundle
from hmscale.data.bundle import tokenized_streams
from hmscale.data.sources import HFSource
from hmscale.data.tokenizer import train_bpe


class _Quota:
    """A file whose writes fail with ENOSPC once ``left`` bytes are taken, as a real write() does: no file named."""

    def __init__(self, f, left):
        self._f, self._left = f, left

    def write(self, data):
        n = memoryview(data).nbytes
        if n > self._left[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._left[0] -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("full_in", ["tokens.raw", "tokens.npy"])
def test_a_full_disk_while_writing_the_stream_is_one_line_naming_the_cache_file(tmp_path, monkeypatch, full_in):
    import datasets

    docs = [f"document {i}: " + "state space model chunk scan " * (5 + i % 7) for i in range(400)]
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    source = HFSource(str(tmp_path / "saved"), val_fraction=0.1)
    tok = train_bpe(docs[:50], 300)
    clean = tokenized_streams(source, tok, tok.eos_token_id, tmp_path / "clean", log=lambda *a: None, batch_docs=16)

    real_open, left = open, [20_000]

    def quota_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return _Quota(f, left) if str(path).endswith(full_in) and ("w" in mode or "a" in mode) else f

    monkeypatch.setattr(bundle, "open", quota_open, raising=False)
    with pytest.raises(OSError) as err:
        tokenized_streams(source, tok, tok.eos_token_id, tmp_path / "dc", log=lambda *a: None, batch_docs=16)
    line = storage_error_line(err.value, "hmscale prepare")
    assert err.value.errno == errno.ENOSPC and str(tmp_path / "dc" / "tokens") in line, line
    assert "writing a file failed" not in line and "\n" not in line, line
    assert not [p for p in (tmp_path / "dc" / "tokens").iterdir() if not p.name.startswith(".")]  # no entry appeared
    monkeypatch.undo()
    again = tokenized_streams(source, tok, tok.eos_token_id, tmp_path / "dc", log=lambda *a: None, batch_docs=16)
    assert again.name == clean.name
    meta, want = (json.loads((d / "meta.json").read_text()) for d in (again, clean))
    assert meta == want
    for name in ("train.tokens.npy", "train.doc_lens.npy", "validation.tokens.npy", "validation.doc_lens.npy"):
        assert (again / name).read_bytes() == (clean / name).read_bytes(), name
