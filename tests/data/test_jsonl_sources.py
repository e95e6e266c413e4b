"""JSON Lines corpora as users have them: fields other than `data.text_field` that appear, vanish or change type
past the first 10 MB (they stopped the preparation: `datasets` fixes a file's schema from its first chunk), a
document longer than a parse block, and a file holding only a byte-order mark."""

import json

import pytest

from hmscale.data.sources import FileSource

ROWS = 90_000  # ~12 MB of rows: past `datasets`' 10 MB first chunk


def _big(path, first: dict, late: dict, late_rows: int = 5):
    docs = [f"doc {i} " + "lorem ipsum " * 10 for i in range(ROWS)] + [f"late document {i}" for i in range(late_rows)]
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, **(first if i < ROWS else late)}) + "\n")
    return docs


@pytest.mark.parametrize("first, late", [
    ({}, {"meta": {"source": "web"}}),  # a field only some later rows carry
    ({"url": None}, {"url": "https://example.org"}),  # an optional field null in the first 10 MB
    ({"score": 1}, {"score": 0.5}),  # ints, then a float
    ({"meta": {"a": 1}}, {"meta": {"b": "x"}}),  # a struct whose keys change
], ids=["late-field", "null-then-string", "int-then-float", "struct-keys"])
def test_other_fields_of_a_large_jsonl_file_do_not_matter(tmp_path, first, late):
    docs = _big(tmp_path / "corpus.jsonl", first, late)
    src = FileSource([str(tmp_path / "corpus.jsonl")], val_fraction=0.1)
    train, val = src.documents("train"), src.documents("validation")
    assert len(train) + len(val) == len(docs) and sorted(train + val) == sorted(docs)
    assert any(d.startswith("late document") for d in train + val)


def test_a_text_field_that_appears_only_past_the_first_chunk_is_read(tmp_path):
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        for i in range(ROWS):
            f.write(json.dumps({"title": f"row {i} " + "lorem ipsum " * 10}) + "\n")
        f.write(json.dumps({"text": "the only document"}) + "\n")
    src = FileSource([str(path)], val_fraction=0.01)
    assert src.documents("train") + src.documents("validation") == ["the only document"]
    assert src.skipped["train"] == ROWS  # the rows without the field are counted as null documents


def test_a_document_longer_than_a_parse_block_is_read_whole(tmp_path):
    docs = ["short one", "x" * 20_000_000 + " long", "short two"]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    src = FileSource([str(tmp_path / "c.jsonl")], val_fraction=0.01)
    got = src.documents("train") + src.documents("validation")
    assert sorted(len(d) for d in got) == sorted(len(d) for d in docs) and sorted(got) == sorted(docs)


def test_the_order_and_errors_of_small_files_are_unchanged(tmp_path):
    docs = [f"document {i} " * 5 for i in range(40)]
    (tmp_path / "a.jsonl").write_text("\ufeff" + "".join(json.dumps({"text": d, "id": i}) + "\r\n\r\n"
                                                          for i, d in enumerate(docs)))
    src = FileSource([str(tmp_path / "a.jsonl")], val_fraction=0.2)
    assert sorted(src.documents("train") + src.documents("validation")) == sorted(docs)
    train = src.documents("train")
    assert train == [d for d in docs if d in set(train)]  # file order

    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"^data.text_field: 'text' is not a column of '.*b.jsonl'; choose one of body$"):
        FileSource([str(tmp_path / "b.jsonl")]).documents("train")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match=r"^data.text_field: 'text' of '.*c.jsonl' holds list values \('\[1, 2\]'\), not text"):
        FileSource([str(tmp_path / "c.jsonl")], val_fraction=0.01).documents("train")


def test_a_file_holding_only_a_byte_order_mark_is_no_documents(tmp_path):
    # Notepad saves an empty UTF-8 file as the three bytes of a BOM; it stopped the preparation with
    # "is not readable as jsonl: Instruction "train" corresponds to no data!"
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    (tmp_path / "empty.jsonl").write_bytes(b"\xef\xbb\xbf\r\n")
    (tmp_path / "empty.json").write_bytes(b"\xef\xbb\xbf[]")
    src = FileSource([str(tmp_path / "*")], val_fraction=0.01)
    assert src.documents("train") + src.documents("validation") == ["a document"]


def test_a_row_longer_than_a_block_past_the_first_blocks_gives_each_row_once(tmp_path, monkeypatch):
    monkeypatch.setattr(FileSource, "JSON_BLOCK", 1 << 12)  # rows are handed out, then the reader restarts larger
    docs = [f"document {i} " * 8 for i in range(400)] + ["y" * 50_000] + [f"after {i} " * 8 for i in range(400)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    src = FileSource([str(tmp_path / "c.jsonl")], val_fraction=0.2)
    train, val = src.documents("train"), src.documents("validation")
    assert sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d in set(train)]  # in file order
