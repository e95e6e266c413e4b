"""Local files (txt, jsonl, parquet) through `datasets`, and prepare_data on them with a named tokenizer."""

import json

import pytest

from hmscale.config import build_config
from hmscale.data import prepare_data
from hmscale.data.sources import FileSource, source_from_config


@pytest.fixture()
def files(tmp_path):
    docs = [f"document number {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 3) for i in range(60)]
    (tmp_path / "a.txt").write_text(docs[0])
    (tmp_path / "b.txt").write_text(docs[1])
    with open(tmp_path / "c.jsonl", "w") as f:
        for d in docs[2:40]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs[40:]}), tmp_path / "d.parquet")
    return tmp_path, docs


def test_file_source_reads_all_formats_and_splits_by_content(files):
    root, docs = files
    src = FileSource([str(root / "*.txt"), str(root / "c.jsonl"), str(root / "d.parquet")], val_fraction=0.2)
    train, val = src.documents("train"), src.documents("validation")
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    again = FileSource([str(root / "*")], val_fraction=0.2)
    assert again.documents("train") == train and again.documents("validation") == val
    assert str(root) not in src.description  # machine independent


def test_missing_path_and_bad_extension(files, tmp_path):
    root, _ = files
    with pytest.raises(FileNotFoundError, match="data.paths"):
        FileSource([str(root / "nope.jsonl")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported extension"):
        FileSource([str(tmp_path / "x.csv")])


@pytest.mark.parametrize("name, content, says", [
    ("bad.jsonl", b'{"text": "a fine first row"}\nnot json at all\n', "not readable as jsonl: JSON parse error"),
    ("bad.parquet", b"PAR1 these bytes are no parquet table", "not readable as parquet"),
    ("bad.txt", "caf\u00e9 au lait".encode("latin-1"), "is not UTF-8 text"),
])
def test_unreadable_file_is_one_line_naming_it(tmp_path, name, content, says):
    (tmp_path / name).write_bytes(content)
    src = FileSource([str(tmp_path / name)])
    with pytest.raises(ValueError) as err:
        src.documents("train")
    msg = str(err.value)
    assert msg.startswith("data.paths: ") and repr(str(tmp_path / name)) in msg and says in msg
    assert "\n" not in msg and err.value.__cause__ is None  # one line, not the library's chained traceback


def test_prepare_data_from_files(files, tmp_path):
    root, _ = files
    cfg = build_config({"tokenizer": {"vocab_size": 300},
                        "data": {"source": "files", "paths": [str(root / "*")], "seq_len": 32, "sequences_per_shard": 4,
                                 "val_fraction": 0.2, "cache_dir": str(tmp_path / "cache")}})
    assert source_from_config(cfg.data).description.startswith("files:")
    data = prepare_data(cfg, log=lambda *a: None)
    assert data.plan.num_shards >= 2 and data.val_tokens.shape[1] == 32
    shard = data.plan.shard(0)
    assert shard["tokens"].shape == (4, 32)


def test_hf_source_error_names_the_field(monkeypatch):
    from hmscale.data.sources import HFSource

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = HFSource("hmscale-test/no-such-dataset", val_fraction=0.1)
    assert src.description.startswith("hf:hmscale-test/no-such-dataset:")
    with pytest.raises(RuntimeError, match="data.dataset") as err:
        src.documents("train")
    assert "\n" not in str(err.value)


def test_a_folder_in_paths_reads_its_supported_files(tmp_path):
    """A folder in data.paths is its .txt / .jsonl / .parquet files (recursively, hidden ones left out); it used to
    give no file at all, so prepare tokenised an empty corpus and blamed data.seq_len."""
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps({"text": "second document"}) + "\n")
    (tmp_path / "README.md").write_text("not a document")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "c.txt").write_text("hidden")
    src = FileSource([str(tmp_path)], val_fraction=0.01)
    assert [p.split("/")[-1] for p in src.files] == ["a.txt", "b.jsonl"]
    assert sorted(src.documents("train") + src.documents("validation")) == ["first document", "second document"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .txt"):
        FileSource([str(tmp_path / "empty")])


def test_a_text_field_of_numbers_is_one_line_not_silently_dropped(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"text": 5}) + "\n" + json.dumps({"text": 7}) + "\n")
    (tmp_path / "y.txt").write_text("a real document")
    src = FileSource([str(tmp_path / "*")], val_fraction=0.01)
    with pytest.raises(ValueError, match=r"'text' of '.*x.jsonl' holds int values"):
        src.documents("train")


def test_empty_and_null_documents_are_reported(tmp_path):
    from hmscale.data.bundle import tokenized_streams
    from hmscale.data.tokenizer import train_bpe

    rows = [{"text": f"document {i} " * 20} for i in range(30)] + [{"text": ""}, {"text": None}]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "e.txt").write_text("")
    src = FileSource([str(tmp_path / "*")], val_fraction=0.2)
    tok = train_bpe(src.training_texts(None), 300)
    logs = []
    tokenized_streams(src, tok, tok.eos_token_id, tmp_path / "cache", log=logs.append)
    assert any("skipped 3 empty or null documents" in m for m in logs), logs


def test_training_texts_reads_only_what_it_needs():
    """The BPE's training texts stop at max_chars without reading (and holding) the whole train split."""
    from hmscale.data.sources import _TableSource

    class Endless(_TableSource):
        description = "endless"

        def _texts(self):
            i = 0
            while True:
                i += 1
                if i > 5000:
                    raise AssertionError("read the whole split")
                yield f"document {i} " * 10

    texts = Endless(0.05, None).training_texts(2000)
    assert 0 < sum(map(len, texts)) < 2300


def test_a_cache_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    cfg = build_config({}, [f"data.cache_dir={tmp_path}/file/sub"])
    with pytest.raises(ValueError) as err:
        prepare_data(cfg, log=lambda *a: None)
    assert str(err.value).startswith(f"data.cache_dir: '{tmp_path}/file/sub': cannot create it (Not a directory)")
    assert err.value.__cause__ is None


def test_a_validation_split_shorter_than_a_row_says_what_to_raise(files, tmp_path):
    root, _ = files
    cfg = build_config({"tokenizer": {"vocab_size": 300},
                        "data": {"source": "files", "paths": [str(root / "*.*")], "seq_len": 256, "sequences_per_shard": 1,
                                 "val_fraction": 0.02, "cache_dir": str(tmp_path / "cache")}})
    with pytest.raises(ValueError) as err:
        prepare_data(cfg, log=lambda *a: None)
    msg = str(err.value)
    assert msg.startswith("data.val_fraction: the validation split has ") and "fewer than one row of 256" in msg
    assert "max_documents" not in msg  # not set, so raising it is no advice
    cfg = build_config({"tokenizer": {"vocab_size": 300},
                        "data": {"source": "files", "paths": [str(root / "*.*")], "seq_len": 256, "sequences_per_shard": 1,
                                 "val_fraction": 0.02, "max_documents": 50, "cache_dir": str(tmp_path / "cache2")}})
    with pytest.raises(ValueError, match="raise data.val_fraction, data.max_documents"):
        prepare_data(cfg, log=lambda *a: None)
