"""Teacher cache on a GPU (skipped without one; `benchmarks/gpu_session.sh tests` runs it): the device path (encode
on the device, non-blocking copies into pinned buffers on a side stream, every forward on the worker's launcher
thread, several shards in flight) stores what the teacher computes there, bit for bit in bf16, and its bytes do not
depend on the number of writers."""

import pytest
import torch

from hmscale.teacher.cache import CacheReader, build_cache, verify_cache
from hmscale.teacher.cache.worker import WRITERS_ENV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_gpu_cache_reads_back_live_capture_bitwise(tmp_path, teacher, tools, monkeypatch):
    data = tools.make_data(shards=5, per_shard=3)
    monkeypatch.setenv(WRITERS_ENV, "3")
    cfg = tools.make_cfg(tmp_path / "three", **{"cache.capture.topk": 4})
    path = build_cache(cfg, data, teacher, engine="local", device="cuda")
    assert verify_cache(path).ok
    reader = CacheReader(path)
    layers = [0, 1]
    for shard in range(data.plan.num_shards):
        live = tools.live_capture(teacher, data.plan, shard, cfg.cache.batch_size, layers)
        for j in range(3):
            s = reader.sample(shard, j, layers=layers, topk=True)
            for i in layers:
                a_in, a_out = live[s["key"]][i]
                assert torch.equal(s["layers"][i]["attn_input"], a_in.to(torch.bfloat16))
                assert torch.equal(s["layers"][i]["attn_output"], a_out.to(torch.bfloat16))
            ids = s["tokens"][None].to("cuda")
            with torch.no_grad():
                logp = torch.log_softmax(teacher(ids).logits.float(), -1)[0].cpu()
            vals = logp.gather(-1, s["topk_indices"].long())
            assert torch.equal(vals, logp.topk(4, -1).values)  # the stored indices are a top 4 (ties in any order)
            torch.testing.assert_close(s["topk_logprobs"], vals, atol=2e-3, rtol=1e-3)  # fp16 storage
    # one writer: the same bytes
    monkeypatch.setenv(WRITERS_ENV, "1")
    one = build_cache(tools.make_cfg(tmp_path / "one", **{"cache.capture.topk": 4}), data, teacher, engine="local",
                      device="cuda")
    shards = lambda d: {k: v for k, v in tools.shard_bytes(d).items() if k.startswith("shard-")}  # noqa: E731
    assert len(shards(path)) == 5 and shards(one) == shards(path)


def test_gpu_fp8_and_token_fraction(tmp_path, teacher, tools):
    data = tools.make_data(shards=2, per_shard=3)
    cfg = tools.make_cfg(tmp_path, **{"cache.capture.dtype": "fp8_e4m3", "cache.capture.token_fraction": 0.25})
    path = build_cache(cfg, data, teacher, engine="local", device="cuda")
    assert verify_cache(path).ok
    reader = CacheReader(path)
    for shard in range(2):
        live = tools.live_capture(teacher, data.plan, shard, cfg.cache.batch_size, [0, 1])
        for j in range(3):
            s = reader.sample(shard, j, layers=[0, 1])
            for i in (0, 1):
                a_in = live[s["key"]][i][0].float()
                got = s["layers"][i]["attn_input"].float()
                rel = ((got - a_in).norm(dim=-1) / a_in.norm(dim=-1)).max().item()
                assert rel < 0.08, rel  # e4m3: 3 mantissa bits
                kept = s["positions"]
                assert s["layers"][i]["attn_output"].shape[0] == kept.numel() == 8  # 25 % of 32 positions
