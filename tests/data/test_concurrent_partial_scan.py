"""Concurrent preparations of *different* data settings in one data.cache_dir (e.g. `hmscale scale run` warming each
data group at once): the scan for other entries' `.partial` directories must not crash when another builder finishes
(renames its `.partial` into place) or removes a file in it meanwhile, and must not call a build in progress
"interrupted ... delete it"."""

import fcntl
import os
from pathlib import Path

from hmscale.data.bundle import tokenized_streams
from hmscale.data.sources import TextSource
from hmscale.data.tokenizer import train_bpe

DOCS = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 20 for i in range(40)]


class _Source(TextSource):
    description = "walk-concurrent"

    def documents(self, split):
        return DOCS[:36] if split == "train" else DOCS[36:]

    def key(self, split):
        return f"walk-concurrent-{split}"


def _other_partial(cache: Path) -> Path:
    other = cache / "tokens" / ".0123456789abcdef.partial"  # another data setting's build
    other.mkdir(parents=True)
    (other / "train.tokens.raw").write_bytes(b"\0" * 64)
    return other


def test_another_builder_finishing_during_the_scan_is_no_crash(tmp_path, monkeypatch):
    tok = train_bpe(DOCS, 300)
    other = _other_partial(tmp_path)
    orig_glob = Path.glob

    def glob(self, pattern, *a, **k):  # the other builder renames its entry into place right after our listing
        found = list(orig_glob(self, pattern, *a, **k))
        if pattern == ".*.partial" and other.exists():
            os.rename(other, other.parent / "0123456789abcdef")
        return iter(found)

    monkeypatch.setattr(Path, "glob", glob)
    logs = []
    out = tokenized_streams(_Source(), tok, tok.eos_token_id, tmp_path, log=logs.append)
    assert (out / "meta.json").exists() and (out / "train.tokens.npy").exists()
    assert not any("delete it" in line for line in logs)


def test_a_file_removed_during_the_scan_is_no_crash(tmp_path, monkeypatch):
    tok = train_bpe(DOCS, 300)
    other = _other_partial(tmp_path)
    raw = other / "train.tokens.raw"
    orig_is_file = Path.is_file

    def is_file(self):  # the other builder removes its raw file (closing the split) right after we saw it
        found = orig_is_file(self)
        if self == raw and found:
            raw.unlink()
        return found

    monkeypatch.setattr(Path, "is_file", is_file)
    out = tokenized_streams(_Source(), tok, tok.eos_token_id, tmp_path, log=lambda *a: None)
    assert (out / "meta.json").exists()


def test_a_build_in_progress_is_not_called_interrupted(tmp_path):
    tok = train_bpe(DOCS, 300)
    other = _other_partial(tmp_path)
    with open(other.parent / ".0123456789abcdef.lock", "a") as lock:  # its builder holds the lock: it is running
        fcntl.flock(lock, fcntl.LOCK_EX)
        logs = []
        tokenized_streams(_Source(), tok, tok.eos_token_id, tmp_path, log=logs.append)
    assert not any("0123456789abcdef" in line and "delete it" in line for line in logs), logs
    # once no one holds it, it is an interrupted preparation, and said so
    logs = []
    tokenized_streams(_Source(), tok, tok.eos_token_id, tmp_path / "again", log=logs.append)  # (fresh cache: no scan)
    (tmp_path / "again" / "tokens" / ".0123456789abcdef.partial").mkdir()
    _Source.description = "walk-concurrent-2"
    try:
        tokenized_streams(_Source(), tok, tok.eos_token_id, tmp_path / "again", log=logs.append)
    finally:
        _Source.description = "walk-concurrent"
    assert any("0123456789abcdef" in line and "delete it" in line for line in logs), logs
