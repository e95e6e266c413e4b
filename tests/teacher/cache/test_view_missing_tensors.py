"""Asking a cache for a tensor its capture does not hold is refused the same way for a view and for a cache built for
the same request: the view read it from its source (docs: a view reads only its own layers and tensors), the cache
called its own healthy shard corrupted ("do not train on it")."""

import pytest

from hmscale.teacher.cache import CacheReader, build_cache
from hmscale.teacher.cache.format import CacheCorruptError, CacheError
from hmscale.teacher.cache.manifest import Manifest


def test_a_tensor_outside_the_capture_is_refused_by_a_view_and_by_its_own_cache(tmp_path, teacher, data, tools):
    build_cache(tools.make_cfg(tmp_path / "root"), data, teacher, engine="local")  # both tensors
    want = {"cache.capture.tensors": "[attn_input]"}
    view = build_cache(tools.make_cfg(tmp_path / "root", **want), data, teacher, engine="local")
    own = build_cache(tools.make_cfg(tmp_path / "own", **want), data, teacher, engine="local")
    assert Manifest.load(view).view_of and not Manifest.load(own).view_of
    for path in (view, own):
        reader = CacheReader(path)
        with pytest.raises(CacheError, match=r"holds tensors \['attn_input'\], not \['attn_output'\]") as err:
            reader.sample(0, 0, layers=[0], tensors=["attn_output"])
        assert not isinstance(err.value, CacheCorruptError)
        with pytest.raises(CacheError, match="not"):
            next(iter(reader.stage1_batches([0], 2, tensors=["attn_input", "attn_output"])))
        assert set(reader.sample(0, 0, layers=[0])["layers"][0]) == {"attn_input"}  # what it holds, still read
