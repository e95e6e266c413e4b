"""Text sources: a Hugging Face dataset, local files (txt / jsonl / parquet), or the embedded corpus.

Every source yields whole documents (strings) for a split, "train" or "validation". The
split is deterministic: the embedded corpus buckets files by a hash of their relative path,
the other sources bucket documents by a hash of their text (duplicates land on the same side).
`description` is machine-independent (it enters the shard-plan hash); `key(split)` is a
cheap identity of a split's content used to key on-disk caches.
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

from hmscale.data.corpus import EmbeddedCorpus, split_of, val_cap


class TextSource:
    description: str = ""

    def documents(self, split: str) -> list[str]:
        raise NotImplementedError

    def iter_documents(self, split: str):
        """The documents of a split, in order, one at a time (a large source streams them: bounded memory)."""
        yield from self.documents(split)

    def key(self, split: str) -> str:
        raise NotImplementedError

    def training_texts(self, max_chars: int | None) -> list[str]:
        """The first train documents (sorted, deterministic) up to about max_chars characters."""
        out, n = [], 0
        for doc in self.iter_documents("train"):  # streamed: a large split is read only as far as max_chars
            if max_chars is not None and n >= max_chars:
                break
            out.append(doc)
            n += len(doc)
        return out


class EmbeddedSource(TextSource):
    def __init__(self, val_fraction: float = 0.05, max_documents: int | None = None, include_tests: bool = False, root=None,
                 include_site_packages: bool = False):
        self.corpus = EmbeddedCorpus(val_fraction, max_documents, include_tests, root, include_site_packages)
        self.description = self.corpus.description

    def documents(self, split: str) -> list[str]:
        return self.corpus.documents(split)

    def files(self, split: str) -> list[str]:
        return self.corpus.files(split)

    def key(self, split: str) -> str:
        return _sha(self.description, split, self.corpus.listing_digest(split))


class _TableSource(TextSource):
    """Documents from `datasets.Dataset` columns (Arrow, memory-mapped), split by a hash of each text, streamed in
    batches: a source of any size is read with bounded memory."""

    BATCH = 1000

    def __init__(self, val_fraction: float, max_documents: int | None):
        self.val_fraction = val_fraction
        self.max_documents = max_documents
        self.skipped: dict[str, int] = {}  # split -> empty / null documents passed over by the last read of it

    def _tables(self):
        """(dataset, text column) pairs, in document order."""
        raise NotImplementedError

    def _texts(self):
        for ds, column in self._tables():
            yield from self._column(ds, column)

    def _column(self, ds, column: str, name: str | None = None):
        """One table's texts, ``BATCH`` rows at a time; a value neither text nor null stops with one line (it
        would otherwise be dropped without a word)."""
        for batch in ds.select_columns([column]).iter(batch_size=self.BATCH):
            texts = batch[column]
            for t in texts:
                if t is not None and not isinstance(t, str):
                    raise ValueError(f"data.text_field: {column!r} of {name or getattr(self, 'dataset', '?')!r} holds "
                                     f"{type(t).__name__} values ({str(t)[:40]!r}), not text; choose a text column")
            yield from texts

    def iter_documents(self, split: str):
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        cap = self.max_documents if split == "train" else val_cap(self.max_documents, self.val_fraction)
        if cap is not None and cap <= 0:
            return
        n = 0
        self.skipped[split] = 0
        for t in self._texts():
            if not isinstance(t, str) or not t:
                self.skipped[split] += 1  # counted on both splits' reads (an empty text has no split of its own)
                continue
            if split_of(hashlib.sha256(t.encode()).hexdigest(), self.val_fraction) != split:
                continue
            yield t
            n += 1
            if cap is not None and n >= cap:
                return

    def documents(self, split: str) -> list[str]:
        return list(self.iter_documents(split))

    def key(self, split: str) -> str:
        return _sha(self.description, split, self._identity())

    def _identity(self) -> str:
        return ""


class HFSource(_TableSource):
    """`datasets.load_dataset(dataset, dataset_config, split=split)[text_field]`; with ``streaming`` the dataset is
    read from the hub as it is tokenised (no full download: with ``data.max_tokens``, only what the run needs)."""

    def __init__(self, dataset: str, dataset_config: str | None = None, split: str = "train", text_field: str = "text",
                 val_fraction: float = 0.05, max_documents: int | None = None, streaming: bool = False,
                 revision: str | None = None):
        super().__init__(val_fraction, max_documents)
        self.dataset, self.dataset_config, self.split, self.text_field = dataset, dataset_config, split, text_field
        self.streaming, self.revision = bool(streaming), revision
        # (streaming or not, the documents are the same, so is the description; `_identity` tells the two apart)
        self.description = (
            f"hf:{dataset}:{dataset_config}:{split}:{text_field}:val={val_fraction}:max_documents={max_documents}"
            + (f":revision={revision}" if revision else "")
        )
        self._ds = None

    def _dataset(self):
        if self._ds is None:
            import datasets

            try:
                self._ds = datasets.load_dataset(self.dataset, self.dataset_config, split=self.split,
                                                 **({"streaming": True} if self.streaming else {}),
                                                 **({"revision": self.revision} if self.revision else {}))
            except Exception as err:  # noqa: BLE001 - re-raised with the config field named
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise RuntimeError(f"data.dataset: could not load {self.dataset!r} (split {self.split!r}): {first}") from err
            if self._ds.column_names is not None and self.text_field not in self._ds.column_names:
                raise ValueError(
                    f"data.text_field: {self.text_field!r} is not a column of {self.dataset!r}; "
                    f"choose one of {', '.join(self._ds.column_names)}"
                )
        return self._ds

    def _tables(self):
        yield self._dataset(), self.text_field

    def _identity(self) -> str:
        if self.streaming:  # nothing downloaded, no content hash: the name, config and split identify it
            return "streaming"
        return getattr(self._dataset(), "_fingerprint", "") or ""


class FileSource(_TableSource):
    """Local files through `datasets`: .txt (one document per file), .jsonl/.json and .parquet (one per row)."""

    BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}

    def __init__(self, paths: list[str], text_field: str = "text", val_fraction: float = 0.05, max_documents: int | None = None):
        super().__init__(val_fraction, max_documents)
        files: list[str] = []
        for p in paths:
            hits = sorted(glob.glob(os.path.expanduser(p)))
            if not hits:
                raise FileNotFoundError(f"data.paths: {p!r} does not exist; fix the path or remove it")
            found = []
            for h in hits:
                if Path(h).is_dir():  # a folder: the supported files under it (recursively, sorted)
                    found.extend(sorted(str(f) for f in Path(h).rglob("*")
                                        if f.is_file() and f.suffix.lower() in self.BUILDERS
                                        and not any(part.startswith(".") for part in f.relative_to(h).parts)))
                elif Path(h).is_file():
                    found.append(h)
            if not found:
                raise FileNotFoundError(f"data.paths: {p!r} holds no .txt, .jsonl or .parquet file; fix the path or "
                                        "remove it")
            files.extend(found)
        self.files = sorted(dict.fromkeys(files))
        for f in self.files:
            if Path(f).suffix.lower() not in self.BUILDERS:
                raise ValueError(f"data.paths: {f!r} has an unsupported extension; use .txt, .jsonl or .parquet")
        self.text_field = text_field
        # machine independent: names and content hashes, not absolute paths
        self._digests = [(Path(f).name, _file_sha(f)) for f in self.files]
        listing = _sha(*(f"{n}:{d}" for n, d in self._digests))[:16]
        self.description = f"files:{len(self.files)}:{listing}:{text_field}:val={val_fraction}:max_documents={max_documents}"

    def _tables(self):
        """(dataset or None, column or path) per file in document order: .jsonl / .parquet through `datasets` (Arrow,
        memory-mapped: kept for the second split), .txt as (None, path): one document per file, read directly as
        `datasets`' text builder would (utf-8, whole file) without its per-file preparation (0.17-0.25 s a file here)."""
        if getattr(self, "_loaded", None) is None:
            self._loaded = list(self._load_tables())
        return self._loaded

    def _load_tables(self):
        import datasets

        by_builder: dict[str, list[str]] = {}
        for f in self.files:
            by_builder.setdefault(self.BUILDERS[Path(f).suffix.lower()], []).append(f)
        for builder in sorted(by_builder):
            for f in by_builder[builder]:  # file by file: keeps the sorted order of documents
                if builder == "text":
                    yield None, f
                    continue
                try:
                    ds = datasets.load_dataset(builder, data_files=[f], split="train")
                except Exception as err:  # noqa: BLE001 - datasets wraps the parser's error; named with the file
                    raise ValueError(f"data.paths: {f!r} is not readable as {Path(f).suffix.lower()[1:]}: "
                                     f"{_root_cause(err)}; fix or remove the file") from None
                if self.text_field not in ds.column_names:
                    raise ValueError(f"data.text_field: {self.text_field!r} is not a column of {f!r}; choose one of "
                                     f"{', '.join(ds.column_names)}")
                yield ds, self.text_field

    def _texts(self):
        for (ds, column), ds_name in zip(self._tables(), self._table_files()):
            if ds is None:
                with open(column, encoding="utf-8") as fh:
                    try:
                        text = fh.read()
                    except UnicodeDecodeError as err:
                        raise ValueError(f"data.paths: {column!r} is not UTF-8 text ({err.reason} at byte {err.start}); "
                                         "convert it to UTF-8 or remove it") from None
                yield text
            else:
                yield from self._column(ds, column, ds_name)

    def _table_files(self) -> list[str]:
        """The file behind each of ``_tables()``, in the same order."""
        return [f for b in sorted({self.BUILDERS[Path(f).suffix.lower()] for f in self.files})
                for f in self.files if self.BUILDERS[Path(f).suffix.lower()] == b]

    def _identity(self) -> str:
        return self.description


def source_from_config(data_cfg) -> TextSource:
    """Build the source a `DataConfig` describes."""
    if data_cfg.source == "embedded":
        return EmbeddedSource(data_cfg.val_fraction, data_cfg.max_documents,
                              include_site_packages=data_cfg.include_site_packages)
    if data_cfg.source == "hf":
        return HFSource(data_cfg.dataset, data_cfg.dataset_config, data_cfg.split, data_cfg.text_field,
                        data_cfg.val_fraction, data_cfg.max_documents, streaming=getattr(data_cfg, "streaming", False),
                        revision=getattr(data_cfg, "revision", None))
    if data_cfg.source == "files":
        return FileSource(list(data_cfg.paths), data_cfg.text_field, data_cfg.val_fraction, data_cfg.max_documents)
    raise ValueError(f"data.source: unknown source {data_cfg.source!r}; use embedded, hf or files")


def _root_cause(err: BaseException) -> str:
    """The first line of the innermost error behind ``err`` (a library's wrapper names none of the file's trouble)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip()
    return text.splitlines()[0].rstrip(".") if text else type(err).__name__


def _sha(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\0")
    return h.hexdigest()


def _file_sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
