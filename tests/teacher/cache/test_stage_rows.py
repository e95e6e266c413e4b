"""Which rows each stage trains on: the plan's first shards (each a fixed pseudo-random deal of the stream's rows), the same whether
the rows come from the live teacher or a cache, and whatever else the cache holds (top-k for KD, other runs' shards)."""

import numpy as np
import torch

from hmscale.data.plan import shards_for_tokens
from hmscale.teacher.cache import build_cache, open_for_run
from hmscale.teacher.cache.build import plan_meta, stage_shard_ids
from hmscale.train.data import CacheSource, plan_rows


def test_shards_for_tokens_is_a_prefix_and_the_shards_a_uniform_sample_of_the_stream():
    picks = [shards_for_tokens(100, 64, 256, t * 64 * 256) for t in (1, 5, 20, 100, 1000)]
    assert [len(p) for p in picks] == [1, 5, 20, 100, 100]
    assert all(set(a) <= set(b) for a, b in zip(picks, picks[1:]))  # a larger budget holds a smaller one's shards
    assert shards_for_tokens(100, 64, 256, 1) == picks[0]  # at least one shard
    # each shard deals rows from the whole stream (a fixed order, the same on every rebuild), not a contiguous run
    from hmscale.data.plan import ShardPlan

    tokens = np.arange(64 * 400, dtype=np.int32) % 251
    plan = ShardPlan(tokens, np.full(400, 64), 16, 40, source="s")
    first = plan.shard_rows(0)
    assert len(first) == 40 and first.max() - first.min() > plan.num_sequences // 2
    assert sorted(np.concatenate([plan.shard_rows(i) for i in range(plan.num_shards)])) == list(range(plan.num_sequences))
    again = ShardPlan(tokens, np.full(400, 64), 16, 40, source="s")
    assert np.array_equal(again.shard(3)["tokens"], plan.shard(3)["tokens"])
    assert np.array_equal(plan.shard(3)["tokens"], plan.rows(plan.shard_rows(3))[0])


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
