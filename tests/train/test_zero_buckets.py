"""hmscale.train.zero_buckets: the bucketed ZeRO-1/2 gradient path trains exactly as DeepSpeed's own code.

gloo engines on CPU (fp32) over a model with tensors of many sizes, a reduce bucket of 300 elements (several
flushes per backward, and one tensor larger than a bucket), gradient accumulation over two micro-batches, clipping
active; one rank (the gradients skip the bucket) and two ranks (the bucket is reduced, ZeRO-2 frees the other
rank's gradients, parameters straddle the partition boundary). The case itself: zero_buckets_case.py."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_buckets_case import compare, ds_config, engine  # noqa: E402

from hmscale.train import zero_buckets  # noqa: E402
from hmscale.train.engine import init_distributed  # noqa: E402

pytest.importorskip("deepspeed")

CASE = Path(__file__).resolve().parent / "zero_buckets_case.py"


def _same(r):
    assert r["lo"] == r["lt"] and r["lo"][-1] != r["lo"][0], (r["lo"], r["lt"])
    assert r["no"] == r["nt"] and r["no"] > 0.05, (r["no"], r["nt"])  # > the clip: clipping acts
    if "same_params" in r:  # a rank of the two-rank job compared its tensors itself
        assert r["same_params"]
    else:
        assert all(torch.equal(a, b) for a, b in zip(r["po"], r["pt"]))


@pytest.mark.parametrize("tiny", [3, 4])  # an odd element count (a padded partition) and an even one (the step
@pytest.mark.parametrize("stage", [1, 2])  # then reads the gradient buffer as its flat partition)
def test_one_rank_trains_exactly_as_deepspeed(stage, tiny, tmp_path):
    init_distributed()
    _same(compare(stage, ds_config(tmp_path, stage), tiny=tiny))


def test_two_ranks_train_exactly_as_deepspeed(tmp_path, launch_job):
    """ZeRO-1 and ZeRO-2, one launch."""
    cases = [dict(stage=stage, config=ds_config(tmp_path, stage)) for stage in (1, 2)]
    got = launch_job(dict(cases=cases), 2, timeout=300, job=CASE)
    assert len(got) == 2
    for res in got:
        r0, r1 = res["ranks"]
        _same(r0)
        _same(r1)
        assert r0["lo"] != r1["lo"]  # the ranks saw different data, and hold the same parameters
        assert res["params_equal_across_ranks"]


def test_other_configurations_keep_deepspeeds_code(tmp_path):
    init_distributed()
    eng = engine(2, True, ds_config(tmp_path, 2, overlap_comm=True))
    assert not zero_buckets.supported(eng.optimizer)
    assert eng.optimizer.reduce_ipg_grads.__func__ is type(eng.optimizer).reduce_ipg_grads
    assert not zero_buckets.install(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1))


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_step_reads_the_gradient_buffer_as_its_flat_partition(stage, tmp_path):
    """With one rank the gradients sit in the buffer in the partition's order, so the step's flat partition is a
    view of the buffer (no concatenated copy) and holds exactly the concatenated gradients. (An even element
    count: with an odd one DeepSpeed pads the partition with a separate zero tensor, and its flatten is kept.)"""
    init_distributed()
    eng = engine(stage, True, ds_config(tmp_path, stage), tiny=4)
    g = torch.Generator().manual_seed(3)
    for k in range(eng.gradient_accumulation_steps()):  # up to the boundary's backward, before its step
        eng.backward(eng(torch.randn(4, 16, generator=g)))
        if k + 1 < eng.gradient_accumulation_steps():
            eng.step()  # counts the micro-batch (no optimizer step)
    opt = eng.optimizer
    flat = opt._get_preflattened_grad_partition(0)
    assert flat is not None and flat.numel() == int(opt.partition_size[0])
    grads = opt.averaged_gradients[0]
    assert flat.untyped_storage().data_ptr() == grads[0].untyped_storage().data_ptr()  # a view, not a copy
    assert flat.data_ptr() == grads[0].data_ptr()
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in grads]))
