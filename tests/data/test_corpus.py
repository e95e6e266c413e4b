"""The embedded stdlib corpus: a deterministic, disjoint train/validation split by path hash."""

import sysconfig

from hmscale.data.corpus import EmbeddedCorpus, list_stdlib_files, split_of
from hmscale.data.sources import EmbeddedSource


def test_listing_is_sorted_and_skips_site_packages_and_tests():
    files = list_stdlib_files()
    assert files == sorted(files) and len(files) > 300
    assert "os.py" in files and "json/decoder.py" in files
    assert not any("site-packages" in f for f in files)
    assert not any(f.startswith("test/") or "/tests/" in f for f in files)
    with_tests = list_stdlib_files(include_tests=True)
    assert set(files) < set(with_tests)


def test_split_is_deterministic_disjoint_and_by_path():
    a, b = EmbeddedCorpus(val_fraction=0.1), EmbeddedCorpus(val_fraction=0.1)
    train, val = a.files("train"), a.files("validation")
    assert train == b.files("train") and val == b.files("validation")
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(list_stdlib_files())
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15
    assert all(split_of(f, 0.1) == "validation" for f in val)
    # a bigger val fraction only moves files from train to validation
    bigger = EmbeddedCorpus(val_fraction=0.2)
    assert set(val) <= set(bigger.files("validation"))


def test_max_documents_caps_in_sorted_order():
    full = EmbeddedCorpus(val_fraction=0.1)
    capped = EmbeddedCorpus(val_fraction=0.1, max_documents=20)
    assert capped.files("train") == full.files("train")[:20]
    assert capped.files("validation") == full.files("validation")[:2]
    docs = EmbeddedSource(0.1, 20).documents("train")
    root = sysconfig.get_paths()["stdlib"]
    assert docs[0] == open(f"{root}/{full.files('train')[0]}", encoding="utf-8", errors="replace").read()
