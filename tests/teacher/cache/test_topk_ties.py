"""A view reading the first k of a cache's stored top-K is bit for bit a cache built for top-k (docs: Views), also where
the teacher's log-probs tie, as a bfloat16 teacher's do: the stored top-k is the first k of a stable descending sort
(ties by the lower token id), so any top-k is a prefix of any larger one, on every device and for every k."""

import pytest
import torch

from hmscale.teacher.cache import CacheReader, build_cache
from hmscale.teacher.cache.manifest import Manifest


def _rows(path):
    r = CacheReader(path)
    return [r.sample(s, j, topk=True) for s, j in r.order(shuffle=False)]


def test_a_top_k_view_equals_its_own_cache_where_log_probs_tie(tmp_path, data, tools):
    teacher = tools.make_teacher().to(torch.bfloat16)  # bf16 logits: ties among the largest log-probs are common
    cap = {"cache.capture.tensors": "[]"}
    build_cache(tools.make_cfg(tmp_path / "root", **cap, **{"cache.capture.topk": 16}), data, teacher, engine="local")
    view = build_cache(tools.make_cfg(tmp_path / "root", **cap, **{"cache.capture.topk": 4}), data, teacher, engine="local")
    own = build_cache(tools.make_cfg(tmp_path / "own", **cap, **{"cache.capture.topk": 4}), data, teacher, engine="local")
    assert Manifest.load(view).view_of and not Manifest.load(own).view_of

    # the reference: the teacher's log-probs (its forward in the worker's batches of 2 rows), first 4 of a stable
    # descending sort
    refs = []
    for s in range(data.plan.num_shards):
        ids = torch.from_numpy(data.plan.shard(s)["tokens"]).long()
        logits = torch.cat([teacher(ids[i:i + 2], use_cache=False).logits for i in range(0, len(ids), 2)])
        vals, idx = torch.sort(torch.log_softmax(logits.float(), -1), dim=-1, descending=True, stable=True)
        refs += list(zip(vals, idx))
    ties = 0
    for v, o, (vals, idx) in zip(_rows(view), _rows(own), refs, strict=True):
        ties += int((vals[:, 3] == vals[:, 4]).sum())  # a tie across the cut at 4
        for got in (v, o):
            assert torch.equal(got["topk_indices"], idx[:, :4])
            assert torch.equal(got["topk_logprobs"], vals[:, :4].half().float())
    assert ties > 0  # the case at stake occurred


@pytest.mark.parametrize("k", [1, 3, 8])
def test_the_stored_top_k_is_the_stable_sorts_prefix(k):
    from hmscale.teacher.cache.worker import sorted_topk

    g = torch.Generator().manual_seed(k)
    x = torch.randint(-4, 3, (5, 7, 40), generator=g).float()  # many ties
    x[0, 0] = float("-inf")  # zero probabilities (kept as values)
    x[1, 1, :3] = float("-inf")
    ref = torch.sort(x, dim=-1, descending=True, stable=True)
    vals, idx = sorted_topk(x.clone(), k)
    assert torch.equal(idx, ref.indices[..., :k]) and torch.equal(vals, ref.values[..., :k])
