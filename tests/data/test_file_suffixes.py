"""One list of readable suffixes: every suffix the config accepts for data.source=files is one FileSource reads."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hmscale.config import DATA_FILE_SUFFIXES, data_path_problem, unsupported_data_file
from hmscale.data.sources import FileSource


def _write(path, docs):
    s = path.suffix
    if s in (".txt", ".text"):
        path.write_text(docs[0])
    elif s == ".jsonl":
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    elif s == ".json":
        path.write_text(json.dumps([{"text": d} for d in docs]))
    elif s == ".parquet":
        pq.write_table(pa.table({"text": docs}), path)
    else:
        raise AssertionError(f"the test does not know how to write {s}: add it here")


@pytest.mark.parametrize("suffix", DATA_FILE_SUFFIXES)
def test_every_accepted_suffix_is_read(tmp_path, suffix):
    f = tmp_path / f"docs{suffix}"
    docs = ["alpha beta gamma " * 3 + suffix] if suffix in (".txt", ".text") else [f"doc {i} {suffix}" for i in range(7)]
    _write(f, docs)
    assert unsupported_data_file(str(f)) is None and data_path_problem(str(f)) is None
    src = FileSource([str(f)], val_fraction=0.0)
    assert sorted(src.iter_documents("train")) == sorted(docs)


def test_a_suffix_the_config_refuses_is_refused_by_the_source_in_the_same_words(tmp_path):
    f = tmp_path / "docs.csv"
    f.write_text("text\nhello\n")
    with pytest.raises(ValueError) as err:
        FileSource([str(f)])
    assert str(err.value) == unsupported_data_file(str(f))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.csv").write_text("a")
    with pytest.raises(FileNotFoundError) as err:
        FileSource([str(empty)])
    assert str(err.value) == data_path_problem(str(empty))
