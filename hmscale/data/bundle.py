"""`prepare_data(cfg)`: source -> tokenizer -> tokenised stream (cached) -> shard plan + validation rows."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hmscale.atomic import atomic_write_json, writable_dir_problem
from hmscale.data.cachedir import resumable_dir, stable_hash
from hmscale.data.packing import pack, tokenize_documents
from hmscale.data.plan import ShardPlan
from hmscale.data.sources import TextSource, source_from_config
from hmscale.data.tokenizer import get_tokenizer, tokenizer_fingerprint

SPLITS = ("train", "validation")
STREAM_VERSION = 1


@dataclass
class DataBundle:
    tokenizer: object  # a transformers tokenizer (PreTrainedTokenizerFast for the embedded BPE)
    plan: ShardPlan
    val_tokens: np.ndarray  # int32 [n, L]
    val_seq_idx: np.ndarray  # int32 [n, L]
    vocab_size: int
    eos_id: int
    source: str = ""
    stream_dir: str | None = None
    info: dict = field(default_factory=dict)


class StaleCheckpoint(Exception):
    """A split's checkpoint whose files do not hold what it records: the split starts again."""


@contextlib.contextmanager
def _naming(path: Path):
    """An OSError naming no file (a write() or fsync() on a full disk does not) re-raised naming ``path``: the one-line
    error then says which file, and so which filesystem to free."""
    try:
        yield
    except OSError as err:
        if err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise


class _StreamWriter:
    """One split's token stream written as it is tokenised: int32 ids appended to a file, the document lengths kept,
    the digest (``stream_digest``) updated on the way; ``close`` leaves ``{split}.tokens.npy`` / ``.doc_lens.npy``.

    ``checkpoint()`` makes what is written so far durable (the file synced, the lengths saved) and returns the
    position to pass back as ``resume`` after an interruption: the file is cut back to it, the digest re-read from
    it (fast next to tokenising), and appending goes on where it was."""

    def __init__(self, directory: Path, split: str, resume: dict | None = None):
        self.directory, self.split = directory, split
        self.raw = directory / f"{split}.tokens.raw"
        self.lens_path = directory / f"{split}.doc_lens.partial.npy"
        self._sha = hashlib.sha256()
        self.lens: list[np.ndarray] = []
        self.tokens = 0
        if resume is None:
            self._f = open(self.raw, "wb")
            return
        self.tokens = int(resume["tokens"])
        # the lengths file is replaced before progress.json records the checkpoint: it may hold more documents
        # (a later checkpoint's), never fewer; its first `documents` entries are this checkpoint's
        lens = np.load(self.lens_path)[: int(resume["documents"])]
        if len(lens) != int(resume["documents"]) or int(lens.sum()) != self.tokens or self.raw.stat().st_size < 4 * self.tokens:
            raise StaleCheckpoint(f"{self.directory}: the {split} checkpoint does not match its files")
        self.lens = [lens]
        with open(self.raw, "r+b") as f:
            f.truncate(4 * self.tokens)  # whatever was appended after the checkpoint goes
            while chunk := f.read(1 << 24):
                self._sha.update(chunk)
        self._f = open(self.raw, "ab")

    def checkpoint(self) -> dict:
        with _naming(self.raw):
            self._f.flush()
            os.fsync(self._f.fileno())
        lens = np.concatenate(self.lens) if self.lens else np.zeros(0, dtype=np.int64)
        self.lens = [lens]
        tmp = self.lens_path.with_name(self.lens_path.name + ".tmp")
        with _naming(tmp), open(tmp, "wb") as f:
            np.save(f, lens)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.lens_path)
        return {"tokens": int(self.tokens), "documents": int(len(lens))}

    def append(self, tokens: np.ndarray, lens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype="<i4")
        with _naming(self.raw):
            self._f.write(data)  # the array's own buffer, to the file and to the digest: no copies
        self._sha.update(data)
        self.lens.append(np.asarray(lens, dtype=np.int64))
        self.tokens += len(data)

    def close(self) -> tuple[str, int]:
        """(digest, documents)."""
        with _naming(self.raw):
            self._f.close()
        lens = np.concatenate(self.lens) if self.lens else np.zeros(0, dtype=np.int64)
        self._sha.update(np.ascontiguousarray(lens, dtype="<i8").tobytes())
        # plain writes, not a memory map: on a full disk a write raises ENOSPC (one line for the user; the rerun resumes)
        # where a store into a mapped page of the sparse file kills the process with SIGBUS; the same bytes as np.save
        buf = np.empty(1 << 16, dtype="<i4")  # chunked copy through one 256 KB buffer: never the whole stream
        npy = self.directory / f"{self.split}.tokens.npy"
        with _naming(npy), open(self.raw, "rb", buffering=0) as f, open(npy, "wb") as out:
            np.lib.format.write_array_header_1_0(out, {"descr": "<i4", "fortran_order": False, "shape": (self.tokens,)})
            done = 0
            while done < self.tokens:
                n = f.readinto(memoryview(buf)[: min(len(buf), self.tokens - done)].cast("B")) // 4
                if n == 0:
                    raise OSError(f"{self.raw}: ended after {done} of {self.tokens} tokens")
                out.write(memoryview(buf)[:n].cast("B"))
                done += n
            out.flush()
            os.fsync(out.fileno())
        self.raw.unlink()
        with _naming(self.directory / f"{self.split}.doc_lens.npy"):
            np.save(self.directory / f"{self.split}.doc_lens.npy", lens)
        self.lens_path.unlink(missing_ok=True)
        return self._sha.hexdigest(), len(lens)


def _batches(it, n: int, first: int = 16):
    """Lists of up to ``n`` items, the first ones smaller (``first``, doubling): a capped split stops after reading
    about what it needs, a long one soon runs at full batches."""
    batch, size = [], min(first, n)
    for x in it:
        batch.append(x)
        if len(batch) == size:
            yield batch
            batch, size = [], min(2 * size, n)
    if batch:
        yield batch


def token_caps(max_tokens: int | None, val_fraction: float) -> dict[str, int | None]:
    """Tokens to tokenise per split: ``data.max_tokens`` for train (whole documents: the last one may pass it), the
    proportional share for validation; None = the whole split."""
    if max_tokens is None:
        return {"train": None, "validation": None}
    return {"train": int(max_tokens), "validation": max(1, int(round(max_tokens * val_fraction / (1.0 - val_fraction))))}


def tokenized_streams(source: TextSource, tokenizer, eos_id: int, cache_dir: str | Path, log=print,
                      max_tokens: int | None = None, val_fraction: float = 0.05, batch_docs: int = 512,
                      progress_s: float = 30.0, checkpoint_s: float = 60.0) -> Path:
    """Tokenise both splits once, streaming (documents read, tokenised and written in batches: memory stays bounded
    whatever the source's size); cache `{split}.tokens.npy` (int32) and `{split}.doc_lens.npy` atomically.
    ``max_tokens`` stops the train split after that many tokens (``token_caps``). Progress every ``progress_s``.

    Resumable: every ``checkpoint_s`` the stream so far is made durable and its position recorded
    (``progress.json`` in the entry's `.partial` directory); an interrupted run's successor skips the documents
    already tokenised and goes on, to the same bytes and digests as an uninterrupted run."""
    fp = tokenizer_fingerprint(tokenizer)
    spec = {"v": STREAM_VERSION, "tokenizer": fp, "source": source.description,
            "train": source.key("train"), "validation": source.key("validation"), "eos": eos_id}
    caps = token_caps(max_tokens, val_fraction)
    if max_tokens is not None:
        spec["caps"] = caps
    key = stable_hash(spec)
    target = Path(cache_dir) / "tokens" / key
    if (target / "meta.json").exists():
        meta = json.loads((target / "meta.json").read_text())
        log(f"[data] tokens: cached stream at {target} ({meta['train']['tokens']:,} train tokens)")
        return target

    def build(tmp: Path):
        meta = {"source": source.description, "tokenizer_fingerprint": fp, "eos_id": eos_id}
        if max_tokens is not None:
            meta["caps"] = caps
        if (tmp / "meta.json").exists():  # an interrupted run finished the build and was stopped before the rename
            (tmp / "progress.json").unlink(missing_ok=True)
            return
        progress_path = tmp / "progress.json"
        progress = json.loads(progress_path.read_text()) if progress_path.exists() else {}

        def record(split: str, state: dict) -> None:
            progress[split] = state
            atomic_write_json(progress_path, progress)

        for split in SPLITS:
            state = progress.get(split)
            if state and state.get("done"):
                meta[split] = state["meta"]
                log(f"[data] tokens: {split}: already tokenised by an interrupted run ({state['meta']['tokens']:,} tokens)")
                continue
            t0 = last = last_ckpt = time.perf_counter()
            try:
                w = _StreamWriter(tmp, split, resume=state)
            except (StaleCheckpoint, OSError, ValueError, EOFError) as err:  # e.g. killed while closing the split
                log(f"[data] tokens: {split}: cannot resume the interrupted run ({err}); tokenising the split again")
                state = None
                w = _StreamWriter(tmp, split)
            chars, skip = (int(state["chars"]), int(state["documents"])) if state else (0, 0)
            if skip:
                log(f"[data] tokens: {split}: resuming an interrupted run after {skip:,} documents ({w.tokens:,} tokens)")
            for batch in _batches(itertools.islice(source.iter_documents(split), skip, None), batch_docs):
                tokens, lens = tokenize_documents(tokenizer, batch, eos_id)
                if caps[split] is not None and w.tokens + len(tokens) > caps[split]:
                    keep = int(np.searchsorted(np.cumsum(lens), caps[split] - w.tokens, side="left")) + 1
                    tokens, lens, batch = tokens[: int(lens[:keep].sum())], lens[:keep], batch[:keep]
                w.append(tokens, lens)
                chars += sum(len(d) for d in batch)
                now = time.perf_counter()
                if now - last >= progress_s:
                    last = now
                    log(f"[data] tokens: {split}: {sum(len(x) for x in w.lens):,} documents, {w.tokens:,} tokens, "
                        f"{w.tokens / (now - t0):,.0f} tokens/s")
                if caps[split] is not None and w.tokens >= caps[split]:
                    break
                if now - last_ckpt >= checkpoint_s:
                    last_ckpt = now
                    record(split, {**w.checkpoint(), "chars": chars})
            digest, docs = w.close()
            meta[split] = {"documents": docs, "chars": chars, "tokens": int(w.tokens), "digest": digest}
            record(split, {"done": True, "meta": meta[split]})
            log(f"[data] tokens: {split}: {docs} documents -> {w.tokens:,} tokens in {time.perf_counter() - t0:.1f} s")
        skipped = max(getattr(source, "skipped", {}).values(), default=0)  # each split's read counts them all
        if skipped:
            log(f"[data] tokens: skipped {skipped:,} empty or null documents of the source (nothing to tokenise)")
        atomic_write_json(tmp / "meta.json", meta)
        progress_path.unlink()  # after meta.json, the mark of a finished build

    for other in target.parent.glob(".*.partial") if target.parent.is_dir() else []:
        if other.name != f".{target.name}.partial":  # no run of this data will resume it
            try:  # another process may be building it now, finish it (rename it away) or remove its files meanwhile
                if _being_built(other):
                    continue
                size = sum(f.stat().st_size for f in other.iterdir() if f.is_file())
            except OSError:
                continue
            log(f"[data] tokens: {other} ({size / 1e9:.2f} GB) is an interrupted preparation of other data or "
                "settings; delete it if that preparation will not be run again")
    resumable_dir(target, build, log=log)
    log(f"[data] tokens: cached at {target}")
    return target


def _being_built(partial: Path) -> bool:
    """Whether a process holds the build lock of the entry whose `.{key}.partial` this is (``resumable_dir``)."""
    import fcntl

    lock_path = partial.parent / f"{partial.name[: -len('.partial')]}.lock"
    if not lock_path.exists():
        return False
    with open(lock_path) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:  # no file locks on this filesystem: cannot tell
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


def check_cache_dir(cache_dir) -> None:
    """``data.cache_dir`` exists (created here) and takes files, or a one-line ValueError naming it, before any work."""
    path = Path(cache_dir).expanduser()
    problem = writable_dir_problem(path)
    if problem:
        raise ValueError(f"data.cache_dir: {str(path)!r}: {problem}; set it to a directory you can write")


def prepare_data(cfg, log=print) -> DataBundle:
    """Everything the stages need from the data: tokenizer, train shard plan, validation rows."""
    d = cfg.data
    check_cache_dir(d.cache_dir)
    source = source_from_config(d)
    tokenizer = get_tokenizer(cfg, source, log=log)
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("tokenizer.name_or_path: the tokenizer has no eos token; documents need one to be packed")
    stream = tokenized_streams(source, tokenizer, int(eos_id), d.cache_dir, log=log,
                               max_tokens=getattr(d, "max_tokens", None), val_fraction=d.val_fraction)
    meta = json.loads((stream / "meta.json").read_text())
    tokens = np.load(stream / "train.tokens.npy", mmap_mode="r")
    lens = np.load(stream / "train.doc_lens.npy")
    plan = ShardPlan(tokens, lens, d.seq_len, d.sequences_per_shard,
                     tokenizer_fingerprint=meta["tokenizer_fingerprint"], source=source.description,
                     content_digest=meta["train"]["digest"], stream_path=stream / "train")
    if plan.num_sequences == 0:
        raise ValueError(f"data.seq_len: the train split has {len(tokens)} tokens, fewer than one row of {d.seq_len}; "
                         "use more documents or a shorter seq_len")
    val_tokens, val_seq_idx = pack(np.load(stream / "validation.tokens.npy"), np.load(stream / "validation.doc_lens.npy"), d.seq_len)
    if len(val_tokens) == 0:
        more = [f"data.{k}" for k in ("max_documents", "max_tokens") if getattr(d, k, None) is not None]
        n_val = int(np.load(stream / "validation.doc_lens.npy").sum())
        raise ValueError(f"data.val_fraction: the validation split has {n_val} tokens, fewer than one row of "
                         f"{d.seq_len}; raise data.val_fraction" + "".join(f", {k}" for k in more)
                         + ", use more documents or a shorter data.seq_len")
    vocab_size = len(tokenizer)
    log(f"[data] plan {plan.hash}: {plan.num_shards} shards x {plan.sequences_per_shard} x {plan.seq_len} tokens "
        f"({plan.total_tokens:,} train tokens), {len(val_tokens)} validation rows, vocab {vocab_size}")
    return DataBundle(tokenizer=tokenizer, plan=plan, val_tokens=val_tokens, val_seq_idx=val_seq_idx,
                      vocab_size=vocab_size, eos_id=int(eos_id), source=source.description, stream_dir=str(stream),
                      info=meta)
