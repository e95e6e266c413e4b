""".json files of objects over several lines, or of one object of columns, are read in place: the same documents
`datasets` gave (one per object), without its Arrow copy in ~/.cache/huggingface."""
import json

import pytest

from hmscale.data.sources import FileSource


@pytest.fixture
def no_datasets(monkeypatch):
    import datasets

    def refuse(*a, **k):
        raise AssertionError("read through datasets.load_dataset")

    monkeypatch.setattr(datasets, "load_dataset", refuse)


def _docs(path, **kw):
    return list(FileSource([str(path)], val_fraction=0.0, **kw).iter_documents("train"))


def test_objects_over_several_lines_are_one_document_each(tmp_path, no_datasets):
    rows = [{"text": f"document {i}\nwith a second line", "id": i, "meta": {"k": [i, i + 1]}} for i in range(5)]
    f = tmp_path / "pretty.json"
    f.write_text("\ufeff" + "\n".join(json.dumps(r, indent=2) for r in rows) + "\n")
    assert _docs(f) == [r["text"] for r in rows]
    one = tmp_path / "one.json"
    one.write_text(json.dumps(rows[0], indent=4))
    assert _docs(one) == [rows[0]["text"]]


def test_the_same_documents_as_datasets_gave(tmp_path, monkeypatch):
    rows = [{"body": f"text {i} " * (i + 1), "n": i} for i in range(6)] + [{"n": 6}]  # (a row without the field)
    f = tmp_path / "pretty.json"
    f.write_text("\n".join(json.dumps(r, indent=1) for r in rows))
    mine = _docs(f, text_field="body")
    import datasets

    theirs = datasets.load_dataset("json", data_files=[str(f)], split="train")["body"]
    assert mine == [d for d in theirs if d] and len(mine) == len(rows) - 1  # (documents without text are skipped)


def test_one_object_of_columns_over_several_lines(tmp_path, no_datasets):
    texts = [f"column row {i}" for i in range(4)]
    f = tmp_path / "columns.json"
    f.write_text(json.dumps({"text": texts, "id": list(range(4))}, indent=2))
    assert _docs(f) == texts


def test_bad_object_files_are_one_line_errors_naming_the_file(tmp_path, no_datasets):
    f = tmp_path / "cut.json"
    f.write_text('{\n "text": "a"\n}\n{\n "text": "b"\n')
    with pytest.raises(ValueError, match=r"^data.paths: '.*cut.json' is not readable as json: "):
        _docs(f)
    g = tmp_path / "mixed.json"
    g.write_text('{"text": "a",\n "n": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"^data.paths: '.*mixed.json' is not readable as json: objects"):
        _docs(g)
    h = tmp_path / "nofield.json"
    h.write_text('{\n "body": "a"\n}\n')
    with pytest.raises(ValueError, match=r"^data.text_field: 'text' is not a column of .*nofield.json'; choose one of body"):
        _docs(h)
    k = tmp_path / "numbers.json"
    k.write_text('{\n "text": 5\n}\n')
    with pytest.raises(ValueError, match=r"holds int values"):
        _docs(k)


def test_one_object_of_columns_on_one_line(tmp_path, no_datasets):
    texts = [f"column row {i}" for i in range(4)]
    f = tmp_path / "columns.json"
    f.write_text("\ufeff\n" + json.dumps({"text": texts, "id": list(range(4))}) + "\n\n")
    assert _docs(f) == texts  # (was: one JSON Lines row whose text is a list, a one-line error)
    rows = tmp_path / "rows.jsonl"  # a JSON Lines file's row holding a list stays what it is: not text
    rows.write_text(json.dumps({"text": texts}) + "\n")
    with pytest.raises(ValueError, match=r"holds list values"):
        _docs(rows)
    two = tmp_path / "two.json"  # two such rows: JSON Lines, not one object of columns
    two.write_text(json.dumps({"text": texts}) + "\n" + json.dumps({"text": texts}) + "\n")
    with pytest.raises(ValueError, match=r"holds list values"):
        _docs(two)
