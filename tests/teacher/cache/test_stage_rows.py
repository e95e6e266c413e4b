"""Which rows each stage trains on: the shards of a fixed pseudo-random order of the plan's shards, the same whether
the rows come from the live teacher or a cache, and whatever else the cache holds (top-k for KD, other runs' shards)."""

import numpy as np
import torch

from hmscale.data.plan import shards_for_tokens
from hmscale.teacher.cache import build_cache, open_for_run
from hmscale.teacher.cache.build import plan_meta, stage_shard_ids
from hmscale.train.data import CacheSource, plan_rows


def test_shards_for_tokens_is_a_fixed_prefix_closed_choice_not_the_streams_head():
    picks = [shards_for_tokens("ab12" * 4, 100, 64, 256, t * 64 * 256) for t in (1, 5, 20, 100, 1000)]
    assert [len(p) for p in picks] == [1, 5, 20, 100, 100]
    assert all(set(a) <= set(b) for a, b in zip(picks, picks[1:]))  # a larger budget holds a smaller one's shards
    assert picks[1] == shards_for_tokens("ab12" * 4, 100, 64, 256, 5 * 64 * 256)  # fixed by the plan alone
    assert shards_for_tokens("ab12" * 4, 100, 64, 256, 1) == picks[0]  # at least one shard
    heads = [shards_for_tokens(f"{h:016x}", 100, 64, 256, 10 * 64 * 256) for h in range(1, 6)]
    assert all(h != list(range(10)) for h in heads) and len({tuple(h) for h in heads}) == 5


def _rows(source) -> list[tuple]:
    got = source.fetch(np.arange(source.num_sequences))["input_ids"]
    return sorted(tuple(r.tolist()) for r in got)


def test_each_stage_reads_the_same_rows_from_the_plan_and_from_a_cache_with_or_without_topk(tmp_path, teacher, tools):
    data = tools.make_data(shards=8, per_shard=3)  # 8 shards of 96 tokens
    budget = {"budget.total_tokens": 4 * 96, "budget.split": "[0.5,0.5]"}
    plain = tools.make_cfg(tmp_path / "plain", **budget)  # caches stage 1's rows (2 shards)
    topk = tools.make_cfg(tmp_path / "topk", **budget, **{"cache.capture.topk": 4})  # the whole budget's (4)
    meta = plan_meta(data.plan)
    s1, s2 = stage_shard_ids(plain, meta, "stage1"), stage_shard_ids(plain, meta, "stage2")
    assert len(s1) == 2 and len(s2) == 4 and set(s1) < set(s2)
    p_dir = build_cache(plain, data, teacher, engine="local", log=lambda *_: None)
    t_dir = build_cache(topk, data, teacher, engine="local", log=lambda *_: None)
    online1, online2 = _rows(plan_rows(data.plan, s1)), _rows(plan_rows(data.plan, s2))
    assert _rows(CacheSource(open_for_run(plain, p_dir, stage="stage1"), layers=[0], topk=False)) == online1
    assert _rows(CacheSource(open_for_run(topk, t_dir, stage="stage1"), layers=[0], topk=False)) == online1
    assert _rows(CacheSource(open_for_run(topk, t_dir, stage="stage2"), topk=True)) == online2
    # the rows themselves, in the same order from either source (a seed draws the same rows)
    ids = np.arange(6)
    assert torch.equal(plan_rows(data.plan, s1).fetch(ids)["input_ids"],
                       CacheSource(open_for_run(topk, t_dir, stage="stage1"), layers=[0], topk=False).fetch(ids)["input_ids"])
