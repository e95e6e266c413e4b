"""HFSource edge cases: a streamed dataset whose features are unknown until read, and a saved DatasetDict without
the split asked for."""

import pytest

from hmscale.data.sources import HFSource


def _generator_dataset():
    import datasets

    def rows():
        for i in range(40):
            yield {"content": f"document {i} " * 4, "n": i}

    ds = datasets.IterableDataset.from_generator(rows)
    assert ds.column_names is None  # as a hub dataset streamed without known features: nothing to check beforehand
    return ds


def test_a_streamed_dataset_without_the_text_field_is_one_line_naming_its_columns(monkeypatch):
    # `_dataset()` checks column_names, which a streamed dataset of unknown features leaves None: the first batch then
    # died in `datasets` with a bare KeyError: 'text' (a traceback from `hmscale prepare`)
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: _generator_dataset())
    src = HFSource("org/corpus", streaming=True, val_fraction=0.2)
    with pytest.raises(ValueError, match=r"^data.text_field: 'text' is not a column of 'org/corpus'; "
                                         r"choose one of content, n$"):
        src.documents("train")
    good = HFSource("org/corpus", text_field="content", streaming=True, val_fraction=0.2, max_documents=5)
    assert len(good.documents("train")) == 5  # max_documents stops the stream there


def test_a_saved_dataset_dict_without_splits_says_so(tmp_path):
    import datasets

    datasets.DatasetDict({}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"^data.split: 'train' is not a split of the saved dataset .*; it holds no "
                                         r"split; save one with save_to_disk$"):
        HFSource(str(tmp_path / "empty"))
