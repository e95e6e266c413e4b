"""Streaming tokenisation: the cached stream is the one the whole-corpus path gives (bitwise, same digest), memory stays
bounded by a batch whatever the corpus size, `data.max_tokens` tokenises a prefix, and progress is reported."""

import json
import tracemalloc

import numpy as np
import pytest

from hmscale.data.bundle import token_caps, tokenized_streams
from hmscale.data.packing import tokenize_documents
from hmscale.data.plan import stream_digest
from hmscale.data.sources import FileSource
from hmscale.data.tokenizer import train_bpe


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~6 MB of jsonl (3000 documents of ~2 KB) and a small byte-level BPE."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = np.array(["state", "space", "model", "chunk", "scan", "decay", "token", "head", "layer", "gate",
                      "the", "of", "a", "to", "in", "mamba", "hedgehog", "teacher", "student", "cache"])
    docs = [" ".join(words[rng.integers(0, len(words), size=int(rng.integers(200, 500)))]) + f" doc{i}"
            for i in range(3000)]
    path = root / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, train_bpe(docs[:200], 300)


def _whole(src, tok, split):
    tokens, lens = tokenize_documents(tok, src.documents(split), tok.eos_token_id)
    return tokens, lens, stream_digest(tokens, lens)


def test_streamed_cache_equals_the_whole_corpus_path(corpus, tmp_path):
    path, tok = corpus
    src = FileSource([str(path)], val_fraction=0.1)
    out = tokenized_streams(src, tok, tok.eos_token_id, tmp_path, log=lambda *a: None, batch_docs=97)
    meta = json.loads((out / "meta.json").read_text())
    for split in ("train", "validation"):
        tokens, lens, digest = _whole(src, tok, split)
        np.testing.assert_array_equal(np.load(out / f"{split}.tokens.npy"), tokens)
        np.testing.assert_array_equal(np.load(out / f"{split}.doc_lens.npy"), lens)
        assert meta[split]["digest"] == digest and meta[split]["tokens"] == len(tokens)
    assert not list(out.glob("*.raw"))


def test_memory_stays_bounded_by_a_batch(corpus, tmp_path, monkeypatch):
    path, tok = corpus
    monkeypatch.setattr(FileSource, "BATCH", 100)  # documents read from Arrow at a time (default 1000)
    src = FileSource([str(path)], val_fraction=0.1)
    list(src._tables())  # the Arrow tables load once (memory-mapped); what is measured is the streaming
    size = path.stat().st_size
    tracemalloc.start()
    try:
        out = tokenized_streams(src, tok, tok.eos_token_id, tmp_path, log=lambda *a: None, batch_docs=16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    tokens = int(json.loads((out / "meta.json").read_text())["train"]["tokens"])
    # the whole-corpus path held every text (~size) and every token (4 B each) at once
    assert tokens * 4 > size and peak < size / 4, (peak, size, tokens)


def test_max_tokens_tokenises_a_prefix_and_a_proportional_validation_share(corpus, tmp_path):
    path, tok = corpus
    src = FileSource([str(path)], val_fraction=0.1)
    full = tokenized_streams(src, tok, tok.eos_token_id, tmp_path, log=lambda *a: None)
    logs = []
    capped = tokenized_streams(src, tok, tok.eos_token_id, tmp_path, log=logs.append, max_tokens=50_000,
                               val_fraction=0.1, batch_docs=16, progress_s=0.0)
    assert capped != full
    t_full, t_cap = np.load(full / "train.tokens.npy"), np.load(capped / "train.tokens.npy")
    lens = np.load(capped / "train.doc_lens.npy")
    assert 50_000 <= len(t_cap) < 50_000 + lens[-1]  # whole documents: the last one crosses the cap
    np.testing.assert_array_equal(t_cap, t_full[: len(t_cap)])
    v = np.load(capped / "validation.tokens.npy")
    assert token_caps(50_000, 0.1)["validation"] <= len(v) < len(np.load(full / "validation.tokens.npy"))
    assert any("tokens/s" in line for line in logs)  # progress while it works
    meta = json.loads((capped / "meta.json").read_text())
    assert meta["caps"] == {"train": 50_000, "validation": 5556}


def test_hf_streaming_reads_the_same_documents_without_downloading(corpus, tmp_path, monkeypatch):
    """data.streaming: datasets.load_dataset(..., streaming=True) (an IterableDataset; here the hub is stood in for by
    the local jsonl) gives the stream the downloaded dataset gives, and a max_tokens prefix reads only a prefix."""
    import datasets

    from hmscale.data.sources import HFSource

    path, tok = corpus
    calls, revisions = [], []
    real = datasets.load_dataset

    def hub(name, config=None, split="train", **kw):  # the hub, offline: the name maps to the local file
        calls.append(kw.get("streaming", False))
        revisions.append(kw.pop("revision", None))
        return real("json", data_files=[str(path)], split=split, **kw)

    monkeypatch.setattr(datasets, "load_dataset", hub)
    plain = HFSource("org/corpus", val_fraction=0.1)
    streamed = HFSource("org/corpus", val_fraction=0.1, streaming=True)
    a = tokenized_streams(plain, tok, tok.eos_token_id, tmp_path, log=lambda *x: None)
    b = tokenized_streams(streamed, tok, tok.eos_token_id, tmp_path, log=lambda *x: None)
    assert a != b and calls == [False, True]  # separate caches (the streamed one has no content fingerprint)
    pinned = tokenized_streams(HFSource("org/corpus", val_fraction=0.1, streaming=True, revision="abc123"), tok,
                               tok.eos_token_id, tmp_path, log=lambda *x: None)
    assert pinned not in (a, b) and revisions == [None, None, "abc123"]  # data.revision: passed on, part of the key
    for split in ("train", "validation"):
        np.testing.assert_array_equal(np.load(a / f"{split}.tokens.npy"), np.load(b / f"{split}.tokens.npy"))
    seen = []
    orig_texts = HFSource._texts

    def counting(self):
        for t in orig_texts(self):
            seen.append(1)
            yield t

    monkeypatch.setattr(HFSource, "_texts", counting)
    tokenized_streams(streamed, tok, tok.eos_token_id, tmp_path / "capped", log=lambda *x: None, max_tokens=20_000,
                      val_fraction=0.1)
    assert len(seen) < 3000 // 5  # both splits stopped early: most of the dataset was never read


def test_streaming_is_for_the_hub_source():
    from hmscale.config import build_config

    with pytest.raises(Exception, match="data.streaming: reads a Hugging Face dataset"):
        build_config({}, ["data.streaming=true"])
    with pytest.raises(Exception, match="data.revision: pins a Hugging Face dataset"):
        build_config({}, ["data.revision=abc123"])
    hf = ["data.source=hf", "data.dataset=org/corpus"]
    assert build_config({}, hf + ["data.revision=1234567"]).data.revision == "1234567"  # an all-digit sha
    with pytest.raises(Exception, match="read as a number; quote it"):
        build_config({}, hf + ["data.revision=1.10"])


def test_txt_files_are_read_as_datasets_text_builder_reads_them(tmp_path):
    """.txt documents come straight from the file (no per-file `datasets` preparation), exactly what
    `load_dataset("text", sample_by="document")` gives: utf-8, universal newlines, the whole file."""
    import datasets

    texts = ["plain ascii\nsecond line\n", "crlf line one\r\nline two\r\n", "unicode: état, 状態空間, ✓", "x" * 5000,
             "trailing spaces   \n\n\n"]
    paths = []
    for i, t in enumerate(texts * 8):
        p = tmp_path / f"doc{i:03d}.txt"
        p.write_bytes(f"{i} {t}".encode("utf-8"))
        paths.append(p)
    src = FileSource([str(tmp_path / "*.txt")], val_fraction=0.2)
    ours = [t for split in ("train", "validation") for t in src.documents(split)]
    want = []
    for p in paths:
        want.extend(datasets.load_dataset("text", data_files=[str(p)], split="train", sample_by="document")["text"])
    assert sorted(ours) == sorted(want) and len(ours) == len(paths)
    assert all(src._tables()[i][0] is None for i in range(len(paths)))  # no datasets table built for them


class _Killed(Exception):
    pass


@pytest.mark.parametrize("kill_after", [5, 31])  # in the train split; in the validation split (train done)
def test_an_interrupted_tokenisation_resumes_to_the_same_stream(corpus, tmp_path, monkeypatch, kill_after):
    path, tok = corpus
    src = FileSource([str(path)], val_fraction=0.1)
    ref = tokenized_streams(src, tok, tok.eos_token_id, tmp_path / "ref", log=lambda *a: None, batch_docs=97)

    import hmscale.data.bundle as bundle

    real, seen = bundle.tokenize_documents, []

    def dies(tokenizer, batch, eos):
        if len(seen) == kill_after:
            raise _Killed()
        seen.append(len(batch))
        return real(tokenizer, batch, eos)

    monkeypatch.setattr(bundle, "tokenize_documents", dies)
    with pytest.raises(_Killed):
        tokenized_streams(src, tok, tok.eos_token_id, tmp_path / "c", log=lambda *a: None, batch_docs=97, checkpoint_s=0)
    partial = next((tmp_path / "c" / "tokens").glob(".*.partial"))
    assert json.loads((partial / "progress.json").read_text())  # a checkpoint was recorded
    done_before = sum(seen)

    seen.clear()
    monkeypatch.setattr(bundle, "tokenize_documents", lambda *a: (seen.append(len(a[1])), real(*a))[1])
    logs = []
    out = tokenized_streams(src, tok, tok.eos_token_id, tmp_path / "c", log=logs.append, batch_docs=97, checkpoint_s=0)
    assert any("resuming an interrupted run after" in line for line in logs), logs
    total = json.loads((ref / "meta.json").read_text())
    assert sum(seen) == total["train"]["documents"] + total["validation"]["documents"] - done_before  # nothing twice
    assert json.loads((out / "meta.json").read_text()) == total  # same digests, counts
    for name in ("train.tokens.npy", "train.doc_lens.npy", "validation.tokens.npy", "validation.doc_lens.npy"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert not partial.exists()


@pytest.mark.parametrize("die_at", ["between_checkpoint_files", "before_rename", "damaged_lengths"])
def test_kills_at_awkward_moments_still_resume(corpus, tmp_path, monkeypatch, die_at):
    """A kill after a checkpoint's lengths file was replaced but before progress.json recorded it, or after
    meta.json was written but before the entry was renamed into place: the rerun finishes without redoing the work."""
    path, tok = corpus
    src = FileSource([str(path)], val_fraction=0.1)
    ref = tokenized_streams(src, tok, tok.eos_token_id, tmp_path / "ref", log=lambda *a: None, batch_docs=97)

    import hmscale.data.bundle as bundle
    import hmscale.data.cachedir as cachedir

    if die_at in ("between_checkpoint_files", "damaged_lengths"):
        real_write, calls = bundle.atomic_write_json, []

        def write(path, obj):
            calls.append(1)
            if len(calls) == 3:  # the third checkpoint: its lengths file is already in place
                raise _Killed()
            real_write(path, obj)
        monkeypatch.setattr(bundle, "atomic_write_json", write)
    else:
        real_rename = cachedir.os.rename

        def rename(src, dst, *a, **k):
            if str(src).endswith(".partial"):  # the entry's rename into place (not the atomic writes' own)
                raise _Killed()
            return real_rename(src, dst, *a, **k)
        monkeypatch.setattr(cachedir.os, "rename", rename)
    with pytest.raises(_Killed):
        tokenized_streams(src, tok, tok.eos_token_id, tmp_path / "c", log=lambda *a: None, batch_docs=97, checkpoint_s=0)
    monkeypatch.undo()
    if die_at == "damaged_lengths":  # e.g. an OS crash before the lengths file reached the disk
        next((tmp_path / "c" / "tokens").glob(".*.partial/train.doc_lens.partial.npy")).write_bytes(b"")

    real, seen = bundle.tokenize_documents, []
    monkeypatch.setattr(bundle, "tokenize_documents", lambda *a: (seen.append(len(a[1])), real(*a))[1])
    logs = []
    out = tokenized_streams(src, tok, tok.eos_token_id, tmp_path / "c", log=logs.append, batch_docs=97, checkpoint_s=0)
    if die_at == "before_rename":
        assert not seen  # both splits were done: nothing tokenised again
    elif die_at == "damaged_lengths":
        assert any("cannot resume the interrupted run" in line for line in logs), logs
    else:
        assert any("resuming an interrupted run after 48 documents" in line for line in logs), logs
    for name in ("train.tokens.npy", "train.doc_lens.npy", "validation.tokens.npy", "validation.doc_lens.npy", "meta.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())


def test_a_second_builder_waits_and_a_lockless_filesystem_builds_apart(tmp_path, monkeypatch):
    import fcntl
    import threading

    from hmscale.data.cachedir import resumable_dir

    target, logs, order = tmp_path / "entry", [], []
    started = threading.Event()

    def slow(d):
        started.set()
        order.append("first")
        (d / "x").write_text("1")
        import time
        time.sleep(0.5)

    t = threading.Thread(target=resumable_dir, args=(target, slow), kwargs={"log": logs.append})
    t.start()
    started.wait()
    resumable_dir(target, lambda d: order.append("second"), log=logs.append)  # waits, then finds it built
    t.join()
    assert order == ["first"] and (target / "x").read_text() == "1"
    assert any("another process is building it; waiting" in line for line in logs), logs

    def no_locks(*a):
        raise OSError(37, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    other = resumable_dir(tmp_path / "other", lambda d: (d / "y").write_text("2"), log=logs.append)
    assert (other / "y").read_text() == "2" and any("no file locks here" in line for line in logs)
