"""Bringing your own corpus: empty and non-UTF-8 table files, `**` globs, datasets saved with `save_to_disk`, and the
one-line errors of `hmscale cache` / `ray_jobs.cache_teacher` for bad data."""

import json
import shutil

import pytest

from hmscale.data.sources import FileSource, HFSource

DOCS = [f"document number {i}: " + "lorem ipsum dolor sit amet " * (i % 5 + 2) for i in range(30)]


def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def _all(src):
    return sorted(src.documents("train") + src.documents("validation"))


def test_non_utf8_bytes_in_a_jsonl_file_are_one_line_naming_it(tmp_path):
    # Arrow's json reader takes the bytes into a string column; they used to surface as a bare UnicodeDecodeError
    # ("'utf-8' codec can't decode byte 0xe9 ...") naming neither the file nor the setting
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "caf\xe9 au lait"}\n')
    with pytest.raises(ValueError) as err:
        FileSource([str(bad)]).documents("train")
    msg = str(err.value)
    assert type(err.value) is ValueError and msg.startswith("data.paths: ") and repr(str(bad)) in msg
    assert "not UTF-8" in msg and "\n" not in msg


@pytest.mark.parametrize("name, content", [
    ("empty.jsonl", b""),
    ("blank.jsonl", b"\n\n  \n"),
    ("empty.json", b""),
    ("empty-list.json", b" [ ]\n"),
    ("no-rows.parquet", None),
])
def test_a_table_file_without_rows_is_no_documents(tmp_path, name, content):
    # an empty .txt is skipped like an empty document; an empty .jsonl / .json / .parquet stopped the preparation
    # ("is not readable as jsonl: StopIteration", "corresponds to no data", "BatchSize must be greater than 0")
    _jsonl(tmp_path / "a.jsonl", DOCS)
    if content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / name)
    else:
        (tmp_path / name).write_bytes(content)
    src = FileSource([str(tmp_path / "a.jsonl"), str(tmp_path / name)], val_fraction=0.2)
    assert _all(src) == sorted(DOCS)


def test_a_json_file_that_only_starts_like_an_empty_list_is_still_read(tmp_path):
    (tmp_path / "rows.json").write_text("[" + ", ".join(json.dumps({"text": d}) for d in DOCS) + "]")
    assert _all(FileSource([str(tmp_path / "rows.json")], val_fraction=0.2)) == sorted(DOCS)


def test_a_double_star_glob_reaches_files_at_every_depth(tmp_path):
    # glob.glob without recursive=True reads `**` as `*`: `corpus/**/*.jsonl` silently left out corpus/*.jsonl and
    # corpus/x/y/*.jsonl
    root = tmp_path / "corpus"
    (root / "x" / "y").mkdir(parents=True)
    _jsonl(root / "top.jsonl", DOCS[:10])
    _jsonl(root / "x" / "mid.jsonl", DOCS[10:20])
    _jsonl(root / "x" / "y" / "deep.jsonl", DOCS[20:])
    src = FileSource([str(root / "**" / "*.jsonl")], val_fraction=0.2)
    assert [p.split("/")[-1] for p in src.files] == ["top.jsonl", "mid.jsonl", "deep.jsonl"]
    assert _all(src) == sorted(DOCS)


@pytest.mark.parametrize("as_dict", [False, True], ids=["Dataset", "DatasetDict"])
def test_a_dataset_saved_with_save_to_disk_is_read_and_known_by_its_content(tmp_path, as_dict):
    # load_dataset refuses a save_to_disk folder ("Please use `load_from_disk` instead", which no setting does)
    import datasets

    def save(texts, where):
        ds = datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})
        (datasets.DatasetDict({"train": ds}) if as_dict else ds).save_to_disk(str(where))

    save(DOCS, tmp_path / "saved")
    src = HFSource(str(tmp_path / "saved"), val_fraction=0.2)
    assert _all(src) == sorted(DOCS)
    assert str(tmp_path) not in src.description  # moved, it is the same data: the same plan hash
    shutil.move(tmp_path / "saved", tmp_path / "moved")
    moved = HFSource(str(tmp_path / "moved"), val_fraction=0.2)
    assert moved.description == src.description and moved.key("train") == src.key("train")
    save(DOCS[:-1] + ["a changed last document"], tmp_path / "saved")  # rewritten in place: another source
    changed = HFSource(str(tmp_path / "saved"), val_fraction=0.2)
    assert changed.description != src.description and changed.key("train") != src.key("train")
    with pytest.raises(ValueError, match=r"^data.text_field: 'body' is not a column of .*; choose one of text, n$"):
        HFSource(str(tmp_path / "saved"), text_field="body")
    with pytest.raises(ValueError, match="^data.streaming: .* saved with save_to_disk"):
        HFSource(str(tmp_path / "saved"), streaming=True)
    if as_dict:
        with pytest.raises(ValueError, match=r"^data.split: 'validation' is not a split of .*; choose one of train$"):
            HFSource(str(tmp_path / "saved"), split="validation")


def _bad_corpus(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "notes.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    return ["data.source=files", f"data.paths=[{tmp_path / 'corpus'}]", f"data.cache_dir={tmp_path / 'dc'}",
            f"cache.root={tmp_path / 'tc'}", "cache.engine=local", "tokenizer.vocab_size=300"]


def test_hmscale_cache_reports_a_bad_corpus_in_one_line(tmp_path, capsys):
    # `hmscale prepare` said it in one line; `hmscale cache` (which prepares the data first) printed a traceback
    from hmscale.cli import main

    args = [a for o in _bad_corpus(tmp_path) for a in ("-s", o)]
    assert main(["cache", *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hmscale: error: data.paths: ") and "is not UTF-8 text" in err
    assert "\n" not in err and "Traceback" not in err


def test_the_ray_cache_job_reports_a_bad_corpus_in_one_line(tmp_path, capsys):
    from ray_jobs.cache_teacher import main

    args = [a for o in _bad_corpus(tmp_path) for a in ("-s", o)]
    assert main([*args, "--engine", "local"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("cache_teacher: error: data.paths: ") and "\n" not in err


def test_the_config_accepts_a_double_star_glob_whose_files_lie_two_folders_down(tmp_path):
    # the config's existence check read `**` as `*` too: files only at corpus/x/y/ were refused as missing
    from hmscale.config import build_config

    (tmp_path / "corpus" / "x" / "y").mkdir(parents=True)
    _jsonl(tmp_path / "corpus" / "x" / "y" / "deep.jsonl", DOCS)
    cfg = build_config({}, ["data.source=files", f"data.paths=[{tmp_path}/corpus/**/*.jsonl]"])
    assert cfg.data.paths == [f"{tmp_path}/corpus/**/*.jsonl"]
