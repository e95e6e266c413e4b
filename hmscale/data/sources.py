"""Text sources: a Hugging Face dataset, local files (txt / jsonl / parquet), or the embedded corpus.

Every source yields whole documents (strings) for a split, "train" or "validation". The
split is deterministic: the embedded corpus buckets files by a hash of their relative path,
the other sources bucket documents by a hash of their text (duplicates land on the same side).
`description` is machine-independent (it enters the shard-plan hash); `key(split)` is a
cheap identity of a split's content used to key on-disk caches.
"""

from __future__ import annotations

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
        """The first train documents (sorted, deterministic) up to max_chars characters: the document that crosses
        the budget is cut there (at a character, not a byte: a str slice), so one huge document cannot exceed it."""
        out, n = [], 0
        for doc in self.iter_documents("train"):  # streamed: a large split is read only as far as max_chars
            if max_chars is not None and n + len(doc) >= max_chars:
                if max_chars > n:
                    out.append(doc[: max_chars - n])
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
        batches = iter(ds.select_columns([column]).iter(batch_size=self.BATCH))
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except UnicodeDecodeError as err:  # Arrow's json reader keeps invalid UTF-8; it fails here, unnamed
                field, where = ("data.paths", name) if name else ("data.dataset", getattr(self, "dataset", "?"))
                raise ValueError(f"{field}: {where!r} holds text in {column!r} that is not UTF-8 ({err.reason}); "
                                 "convert it to UTF-8 or remove it") from None
            except KeyError as err:  # a streamed dataset of unknown features (column_names None) lacks the column
                if err.args != (column,):
                    raise
                first = next(iter(ds.take(1)), {}) if hasattr(ds, "take") else {}  # (only now: reading costs)
                where = name or getattr(self, "dataset", "?")
                raise ValueError(f"data.text_field: {column!r} is not a column of {where!r}; "
                                 f"choose one of {', '.join(first)}") from None
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
    read from the hub as it is tokenised (no full download: with ``data.max_tokens``, only what the run needs).

    ``dataset`` may also be a folder written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``: ``split``
    picks the split), which ``load_dataset`` refuses: it is read with ``load_from_disk`` (memory-mapped) and
    identified by the content of its Arrow files, not by its path (moved, it is the same data; rewritten, another)."""

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
        self._saved = _saved_dataset_dir(dataset)
        if self._saved is not None:
            if self.streaming or revision:
                raise ValueError(f"data.{'streaming' if self.streaming else 'revision'}: {dataset!r} is a dataset saved "
                                 "with save_to_disk, read from disk; remove the setting (it is for hub datasets)")
            self._ds = self._load_saved()
            listing = _sha(*(f"{Path(f).name}:{_file_sha(f)}" for f in self._arrow_files()))[:16]
            self.description = (f"hf-disk:{listing}:{split if self._is_dict else ''}:{text_field}:val={val_fraction}:"
                                f"max_documents={max_documents}")

    def _load_saved(self):
        import datasets

        try:
            ds = datasets.load_from_disk(str(self._saved))
        except Exception as err:  # noqa: BLE001 - re-raised with the config field named
            raise ValueError(f"data.dataset: could not load the saved dataset {self.dataset!r}: {_root_cause(err)}; "
                             "save it again with save_to_disk") from None
        self._is_dict = isinstance(ds, datasets.DatasetDict)
        if self._is_dict:
            if self.split not in ds:
                raise ValueError(f"data.split: {self.split!r} is not a split of the saved dataset {self.dataset!r}; "
                                 + (f"choose one of {', '.join(ds)}" if len(ds) else
                                    "it holds no split; save one with save_to_disk"))
            ds = ds[self.split]
        if self.text_field not in ds.column_names:
            raise ValueError(f"data.text_field: {self.text_field!r} is not a column of {self.dataset!r}; "
                             f"choose one of {', '.join(ds.column_names)}")
        return ds

    def _arrow_files(self) -> list[str]:
        return [c["filename"] for c in self._ds.cache_files]

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
        if self._saved is not None:  # the description holds its files' content hashes
            return "saved"
        if self.streaming:  # nothing downloaded, no content hash: the name, config and split identify it
            return "streaming"
        return getattr(self._dataset(), "_fingerprint", "") or ""


class FileSource(_TableSource):
    """Local files: .txt (one document per file), .jsonl/.json and .parquet (one per row: a JSON object, or an element
    of a .json file's one object of columns), all read in place."""

    JSON_BLOCK = 1 << 24  # bytes of JSON Lines parsed at a time (more where one row is longer)
    def __init__(self, paths: list[str], text_field: str = "text", val_fraction: float = 0.05, max_documents: int | None = None):
        # (imported here: hmscale.config imports hmscale.teacher, which imports hmscale.data)
        from hmscale.config import DATA_FILE_BUILDERS, _SUFFIXES_TEXT, data_folder_files, expand_data_path, unsupported_data_file

        self.BUILDERS = DATA_FILE_BUILDERS  # one list of readable suffixes, the config's

        super().__init__(val_fraction, max_documents)
        files: list[str] = []
        for p in paths:
            hits = expand_data_path(p)  # the path itself where it exists, else a glob's matches
            if not hits:
                raise FileNotFoundError(f"data.paths: {p!r} does not exist; fix the path or remove it")
            found = []
            for h in hits:
                if Path(h).is_dir():  # a folder: the supported files under it (recursively, sorted)
                    found.extend(sorted(data_folder_files(h)))
                elif Path(h).is_file():
                    found.append(h)
            if not found:
                raise FileNotFoundError(f"data.paths: {p!r} holds no {_SUFFIXES_TEXT} file; fix the path or remove it")
            files.extend(found)
        # one file reached twice (a folder and a file in it, `./x` and `x`, relative and absolute) is read once
        kept: dict[str, str] = {}
        for f in sorted(set(files)):
            kept.setdefault(os.path.realpath(f), f)
        self.files = list(kept.values())  # sorted, as before
        for f in self.files:
            problem = unsupported_data_file(f)
            if problem:
                raise ValueError(problem)
        self.text_field = text_field
        # machine independent: names and content hashes, not absolute paths
        self._digests = [(Path(f).name, _file_sha(f) + _bom_mark(f)) for f in self.files]
        listing = _sha(*(f"{n}:{d}" for n, d in self._digests))[:16]
        self.description = f"files:{len(self.files)}:{listing}:{text_field}:val={val_fraction}:max_documents={max_documents}"

    def _tables(self):
        """(dataset or marker, column or path) per file in document order: JSON Lines, JSON arrays and .parquet as
        markers read in place (``_json_lines_texts``, ``_json_array_texts``, ``_json_objects_texts``, ``_parquet_texts``),
        any other .json (JSON Lines where Arrow has no streaming reader) through `datasets` (Arrow, memory-mapped: kept
        for the second split), .txt as (None, path): one document per file, read
        directly as `datasets`' text builder would (utf-8, whole file) without its per-file preparation (0.17-0.25 s a
        file here)."""
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
                if _holds_no_rows(f, builder):  # an empty file is no documents, as an empty .txt is none (`datasets`
                    yield _NO_ROWS, self.text_field  # stops on one: "StopIteration", "corresponds to no data")
                    continue
                if builder == "parquet":  # read in place, row group by row group (`datasets` wrote an Arrow copy of the
                    yield _PARQUET, self._parquet_column(f)  # whole file, every column, into ~/.cache/huggingface)
                    continue
                if builder == "json" and _has_open_json() and (first := _json_lines_first_row(f)) is not None:
                    if (Path(f).suffix.lower() == ".json" and isinstance(first.get(self.text_field), list)
                            and _nothing_after_first_line(f)):
                        yield _JSON_OBJECTS, self.text_field  # one object of columns on one line: as over several
                        continue
                    yield _JSON_LINES, list(first)  # its first row's fields (the text field alone is read)
                    continue
                if builder == "json" and _json_array(f):  # a list of rows, read in place (`datasets` wrote an Arrow
                    yield _JSON_ARRAY, self.text_field  # copy of it into ~/.cache/huggingface)
                    continue
                if builder == "json" and _json_object(f):  # objects over several lines, or one object of columns:
                    yield _JSON_OBJECTS, self.text_field  # read in place too (`_json_objects_texts`)
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
            if ds is _NO_ROWS:
                continue
            if ds is _JSON_LINES:
                yield from self._json_lines_texts(ds_name, column)
                continue
            if ds is _PARQUET:
                yield from self._parquet_texts(ds_name, column)
                continue
            if ds is _JSON_ARRAY:
                yield from _json_array_texts(ds_name, column)
                continue
            if ds is _JSON_OBJECTS:
                yield from _json_objects_texts(ds_name, column)
                continue
            if ds is None:
                with open(column, encoding="utf-8-sig") as fh:  # a byte-order mark is not text (as in the JSON readers)
                    try:
                        text = fh.read()
                    except UnicodeDecodeError as err:
                        raise ValueError(f"data.paths: {column!r} is not UTF-8 text ({err.reason} at byte {err.start}); "
                                         "convert it to UTF-8 or remove it") from None
                yield text
            else:
                yield from self._column(ds, column, ds_name)

    def _json_lines_texts(self, path: str, first_row: list[str]):
        """The ``text_field`` of each row of a JSON Lines file, in order (None where a row lacks it), streamed with
        Arrow's JSON reader told to parse that field alone: the file's other fields, whatever they hold, do not matter.
        (`datasets` fixes a file's schema from its first 10 MB and stopped on valid files whose other fields appear,
        vanish or change type later: an optional field null at first, ints then a float, a struct's keys.)"""
        import pyarrow as pa
        import pyarrow.json as paj

        column = self.text_field
        parse = paj.ParseOptions(explicit_schema=pa.schema([pa.field(column, pa.string())]),
                                 unexpected_field_behavior="ignore")
        block, done, seen = self.JSON_BLOCK, 0, False
        while True:
            skip = done  # rows handed out before a restart with larger blocks
            try:
                for batch in paj.open_json(path, read_options=paj.ReadOptions(block_size=block), parse_options=parse):
                    col = batch.column(0)
                    for at in range(min(skip, len(col)), len(col), self.BATCH):  # ``BATCH`` Python strings at a time
                        try:
                            texts = col.slice(at, self.BATCH).to_pylist()
                        except UnicodeDecodeError as err:  # Arrow's json reader keeps invalid UTF-8 in string columns
                            raise ValueError(f"data.paths: {path!r} holds text in {column!r} that is not UTF-8 "
                                             f"({err.reason}); convert it to UTF-8 or remove it") from None
                        seen = seen or any(t is not None for t in texts)
                        done += len(texts)
                        yield from texts
                    skip = max(0, skip - len(col))
                break
            except pa.ArrowInvalid as err:
                msg = str(err).strip()
                if "straddling" in msg and block < os.path.getsize(path) + 1:  # a row longer than a block
                    block *= 4
                    continue
                if f"Column(/{column}) changed from" in msg:
                    _raise_non_text(path, column)
                first = msg.splitlines()[0].rstrip(".") if msg else type(err).__name__
                raise ValueError(f"data.paths: {path!r} is not readable as {Path(path).suffix.lower()[1:]}: {first}; "
                                 "fix or remove the file") from None
        if not seen and column not in first_row:  # no row has the field: a wrong data.text_field, not null texts
            raise ValueError(f"data.text_field: {column!r} is not a column of {path!r}; choose one of "
                             f"{', '.join(first_row)}")

    def _parquet_column(self, path: str) -> str:
        """``text_field``, once ``path`` is known to be a Parquet file holding it as text (else a one-line
        ValueError)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"data.paths: {path!r} is not readable as parquet: {_root_cause(err)}; fix or remove the "
                             "file") from None
        column = self.text_field
        if column not in schema.names:
            raise ValueError(f"data.text_field: {column!r} is not a column of {path!r}; choose one of "
                             f"{', '.join(schema.names)}")
        kind = schema.field(column).type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
                or getattr(pa.types, "is_string_view", lambda t: False)(kind)):
            raise ValueError(f"data.text_field: {column!r} of {path!r} holds {kind} values, not text; choose a text "
                             "column")
        return column

    def _parquet_texts(self, path: str, column: str):
        """The ``column`` of a Parquet file, ``BATCH`` rows at a time (memory bounded by a batch, no copy on disk)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=self.BATCH, columns=[column]):
                yield from batch.column(0).to_pylist()
        except (pa.ArrowException, OSError) as err:  # (a file cut short: its footer read, a page not)
            raise ValueError(f"data.paths: {path!r} is not readable as parquet: {_root_cause(err)}; fix or remove the "
                             "file") from None

    def _table_files(self) -> list[str]:
        """The file behind each of ``_tables()``, in the same order."""
        return [f for b in sorted({self.BUILDERS[Path(f).suffix.lower()] for f in self.files})
                for f in self.files if self.BUILDERS[Path(f).suffix.lower()] == b]

    def _identity(self) -> str:
        return self.description


_NO_ROWS = object()  # a table file holding no rows
_JSON_LINES = object()  # a JSON Lines file, read by `FileSource._json_lines_texts`
_PARQUET = object()  # a Parquet file, read by `FileSource._parquet_texts`
_JSON_ARRAY = object()  # a JSON file holding a list of rows, read by `_json_array_texts`


def _json_first_char(path: str) -> bytes:
    """A .json file's first character after a byte-order mark and blanks (b"" when there is none in its first 64 KiB)."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    head = head[3:] if head.startswith(b"\xef\xbb\xbf") else head
    return head.lstrip(b" \t\r\n")[:1]


def _json_array(path: str) -> bool:
    """Whether a .json file holds a JSON array (its first character, after a byte-order mark and blanks, is "[")."""
    return _json_first_char(path) == b"["


def _json_object(path: str) -> bool:
    """Whether a .json file starts with an object (not JSON Lines, which is read first: objects over several lines,
    or one object holding columns)."""
    return _json_first_char(path) == b"{"


_JSON_OBJECTS = object()  # a JSON file of objects (or one object of columns), read by `_json_objects_texts`


def _json_values(path: str) -> list:
    """The top-level JSON values of a .json file, one after another (one for a single array or object), with one-line
    errors naming the file (not UTF-8, not JSON)."""
    import json

    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"data.paths: {path!r} is not UTF-8 text ({err.reason} at byte {err.start}); convert it to "
                         "UTF-8 or remove it") from None
    decoder, values, i = json.JSONDecoder(), [], 0
    try:
        while True:
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i == len(text):
                return values
            value, i = decoder.raw_decode(text, i)
            values.append(value)
    except ValueError as err:  # (json.JSONDecodeError)
        raise ValueError(f"data.paths: {path!r} is not readable as json: {str(err).splitlines()[0]}; fix or remove "
                         "the file") from None


def _json_objects_texts(path: str, column: str):
    """The ``column`` of each object of a .json file holding objects one after another, each over any number of lines
    (as `datasets` reads them: one row each), or, for a file of one object whose ``column`` is a list, each element
    of that list (one object of columns). Same checks and one-line errors as ``_json_array_texts``."""
    values = _json_values(path)
    if len(values) == 1 and isinstance(values[0], dict) and isinstance(values[0].get(column), list):
        values = [{column: t} for t in values[0][column]]  # one object of columns: its text column's elements
    yield from _rows_texts(path, values, column)


def _json_array_texts(path: str, column: str):
    """The ``column`` of each row of a JSON array of objects, in order (None where a row lacks it), with one-line
    errors naming the file (a value neither text nor null, no row holding the field, a file that is not such JSON)."""
    values = _json_values(path)
    rows = values[0] if len(values) == 1 else None  # (an array followed by more JSON: not an array file)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"data.paths: {path!r} is not readable as json: a list of objects ({{{column!r}: text, ...}}) "
                         "is expected; fix or remove the file")
    yield from _rows_texts(path, rows, column)


def _rows_texts(path: str, rows: list, column: str):
    """``column`` of each row (an object) of a .json file, with the one-line errors of the JSON readers."""
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"data.paths: {path!r} is not readable as json: objects ({{{column!r}: text, ...}}) are "
                         "expected; fix or remove the file")
    fields = dict.fromkeys(k for r in rows for k in r)
    if column not in fields:
        raise ValueError(f"data.text_field: {column!r} is not a column of {path!r}; choose one of {', '.join(fields)}")
    for r in rows:
        t = r.get(column)
        if t is not None and not isinstance(t, str):
            raise ValueError(f"data.text_field: {column!r} of {path!r} holds {type(t).__name__} values "
                             f"({str(t)[:40]!r}), not text; choose a text column")
        if t is not None and not _encodable(t):  # a lone surrogate escape ("\ud800"): no UTF-8 text, no tokens
            raise ValueError(f"data.paths: {path!r} holds text in {column!r} that is not valid Unicode (a lone "
                             "surrogate escape such as \\ud800); fix or remove it")
        yield t


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _has_open_json() -> bool:  # Arrow's streaming JSON reader (pyarrow >= 20); before it, `datasets` reads
    import pyarrow.json as paj

    return hasattr(paj, "open_json")


def _json_lines_first_row(path: str) -> dict | None:
    """The first row of a JSON Lines file (an object, whole on its line, after blanks and a byte-order mark), or None
    where the file is something else (a JSON list, an object over several lines: `datasets` reads it)."""
    import json

    with open(path, "rb") as f:
        head = f.read(1 << 16)
        start = 3 if head.startswith(b"\xef\xbb\xbf") else 0
        while start < len(head) and head[start] in b" \t\r\n":
            start += 1
        if start >= len(head) or head[start : start + 1] != b"{":  # a list (or blanks alone): read by `datasets`
            return None
        f.seek(start)
        line = f.readline()  # (one row: read before it is tokenised anyway)
    try:
        row = json.loads(line)
    except ValueError:  # not UTF-8, not whole on its line, or not JSON: `datasets` says which
        return None
    return row if isinstance(row, dict) else None


def _nothing_after_first_line(path: str) -> bool:
    """Whether a file holds nothing but blanks after its first line that is not blank (a byte-order mark skipped): a
    .json file of one object on one line whose text field is a list is one object of columns (read as columns, as the
    same object over several lines is), not a JSON Lines row whose text is a list."""
    with open(path, "rb") as f:
        f.seek(3 if f.read(3) == b"\xef\xbb\xbf" else 0)
        line = f.readline()
        while line and not line.strip():  # (blank lines before it)
            line = f.readline()
        while block := f.read(1 << 20):
            if block.strip():
                return False
    return True


def _raise_non_text(path: str, column: str):
    """Stop with one line naming the first value of ``column`` in a JSON Lines file that is neither text nor null."""
    import json

    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    t = json.loads(line).get(column)
                except (ValueError, AttributeError):
                    continue
                if t is not None and not isinstance(t, str):
                    raise ValueError(f"data.text_field: {column!r} of {path!r} holds {type(t).__name__} values "
                                     f"({str(t)[:40]!r}), not text; choose a text column")
    raise ValueError(f"data.text_field: {column!r} of {path!r} holds values that are not text; choose a text column")


def _saved_dataset_dir(name: str | None) -> Path | None:
    """The folder ``name`` names when ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` wrote it, else None."""
    if not name:
        return None
    path = Path(os.path.expanduser(name))
    marks = ("state.json", "dataset_info.json"), ("dataset_dict.json",)
    if path.is_dir() and any(all((path / m).is_file() for m in ms) for ms in marks):
        return path
    return None


def _holds_no_rows(path: str, builder: str) -> bool:
    """Whether a .jsonl / .json file is blank (whitespace, or an empty JSON list) or a .parquet file has no rows."""
    if builder == "parquet":
        try:
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows == 0
        except Exception:  # noqa: BLE001 - not parquet: `datasets` names the trouble
            return False
    seen = b""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if not seen and f.tell() == len(chunk) and chunk.startswith(b"\xef\xbb\xbf"):  # a byte-order mark
                chunk = chunk[3:]
            seen += bytes(chunk.translate(None, b" \t\r\n"))
            if len(seen) > 2 or not b"[]".startswith(seen):
                return False
    return seen in (b"", b"[]")


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


def _bom_mark(path: str) -> str:
    """A mark in the source's identity for a .txt file starting with a UTF-8 byte-order mark: such files were read
    with the mark as their first character until the sixteenth session, so their data (and everything keyed on it)
    must not match what was built from them then; every other file's identity is unchanged."""
    if Path(path).suffix.lower() not in (".txt", ".text"):
        return ""
    with open(path, "rb") as f:
        return ":bom-dropped" if f.read(3) == b"\xef\xbb\xbf" else ""


def _file_sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
