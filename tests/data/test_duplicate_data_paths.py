"""A file that `data.paths` reaches twice, through different spellings (a folder and a file in it, `./x` and `x`, a
relative and an absolute path), is one file: read once (it was read twice, its documents doubled in the stream)."""

import os

import pytest

from hmscale.data.sources import FileSource


@pytest.fixture()
def corpus(tmp_path, monkeypatch):
    (tmp_path / "dd" / "sub").mkdir(parents=True)
    (tmp_path / "dd" / "a.txt").write_text("alpha document")
    (tmp_path / "dd" / "sub" / "b.txt").write_text("beta document")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("paths", [
    ["./dd", "./dd/a.txt"],
    ["dd/", os.path.join("{root}", "dd", "a.txt")],
    ["dd", "dd/sub/*.txt", "dd/sub/../a.txt"],
])
def test_a_file_named_twice_is_read_once(corpus, paths):
    paths = [p.format(root=corpus) for p in paths]
    src = FileSource(paths, val_fraction=0.01)
    once = FileSource(["dd"], val_fraction=0.01)
    assert sorted(src.documents("train") + src.documents("validation")) == ["alpha document", "beta document"]
    assert len(src.files) == 2 and src.description == once.description  # the same data, the same plan
