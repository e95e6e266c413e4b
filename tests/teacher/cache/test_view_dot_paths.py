"""A view named by a path whose last part is `.` or `..` (a shell inside the view: `hmscale cache verify .`) finds its
source's shards: it was reported corrupted ("the file is missing; do not train on it") while it was whole."""

import pytest
import torch

from hmscale.teacher.cache import CacheReader, build_cache, verify_cache
from hmscale.teacher.cache.catalog import format_catalog, list_caches


@pytest.fixture
def view(tmp_path, teacher, data, tools):
    build_cache(tools.make_cfg(tmp_path, **{"cache.capture.topk": 8}), data, teacher, engine="local")  # the source
    return build_cache(tools.make_cfg(tmp_path, **{"cache.capture.topk": 4}), data, teacher, engine="local")


@pytest.mark.parametrize("how", [".", "sub/.."])
def test_a_view_reached_through_dot_or_dotdot_reads_its_source(view, monkeypatch, how):
    (view / "sub").mkdir()  # (verify names it as not part of the cache; the shards are what matters here)
    monkeypatch.chdir(view)
    report = verify_cache(how)
    assert not report.bad and len(report.shards_ok) == 4, report.summary()
    ref = CacheReader(view)  # the same view, named by its plain path
    got = CacheReader(how)
    for s, j in ref.order(shuffle=False):
        a, b = got.sample(s, j, topk=True), ref.sample(s, j, topk=True)
        assert a["key"] == b["key"] and torch.equal(a["tokens"], b["tokens"])
        assert torch.equal(a["topk_indices"], b["topk_indices"]) and torch.equal(a["topk_logprobs"], b["topk_logprobs"])


def test_cache_list_of_a_view_by_dot_finds_its_source(view, monkeypatch):
    monkeypatch.chdir(view)
    assert "source missing" not in format_catalog(list_caches("."), ".")
