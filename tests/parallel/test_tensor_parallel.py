"""Tensor parallelism: tp=2 over two gloo processes on CPU equals tp=1 (outputs and gradients, fp32)."""

import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_hedgemamba import make_model  # noqa: E402

from hmscale.models.hedgemamba import HedgeMambaCache  # noqa: E402
from hmscale.parallel import (  # noqa: E402
    MeshMPU,
    ParallelMesh,
    apply_tensor_parallel,
    build_mesh,
    gather_tensor_parallel_state_dict,
    trivial_mesh,
)
from hmscale.train.launch import spawn_workers  # noqa: E402

VOCAB = 97
# the tests sharing the tp_runs fixture stay on one xdist worker (`make test`): else each worker would spawn the ranks
pytestmark = pytest.mark.xdist_group("tensor_parallel_tp_runs")


def _inputs():
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, VOCAB, (2, 37), generator=g)


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    (out.loss + out.logits.float().pow(2).mean()).backward()
    with torch.no_grad():
        cache = HedgeMambaCache(model.config.num_hidden_layers)
        pre = model(ids[:, :30], cache=cache, use_cache=True).logits
        steps = [model(ids[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(30, 37)]
    return out.logits.detach(), torch.cat([pre, *steps], 1)


def _worker(rank, models, out_dir):
    torch.set_num_threads(1)
    # first, while this fresh process has no process group: the tp=1 case of test_trivial_mesh_and_mpu_without_distributed
    try:
        _trivial_mesh_case(rank)
        trivial = None
    except BaseException:  # reported by that test
        trivial = traceback.format_exc()
    torch.save(trivial, Path(out_dir) / f"trivial{rank}.pt")
    dist.init_process_group("gloo")
    try:
        mesh = build_mesh(tp=2)
        mpu = MeshMPU(mesh)
        info = dict(tp_rank=mpu.get_model_parallel_rank(), tp_size=mpu.get_tensor_model_parallel_world_size(),
                    dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size(),
                    src=mpu.get_tensor_model_parallel_src_rank())
        for key, model in models.items():  # each model sharded over the same mesh, one after the other
            apply_tensor_parallel(model, mesh)
            logits, decoded = _run(model, _inputs())
            grads = {n: (p.grad.detach().clone(), getattr(p, "tp_split_dim", None)) for n, p in model.named_parameters()}
            full_sd = gather_tensor_parallel_state_dict(model, mesh)
            torch.save(dict(info=info, logits=logits, decoded=decoded, grads=grads, sd=full_sd,
                            n_heads=model.backbone.layers[0].mixer.n_heads),
                       Path(out_dir) / f"{key}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """One spawn of the two tp=2 ranks for every case of this file (a process start is seconds of CPU): the tp=2 runs
    of both residual layouts, and the no-process-group case before the ranks join their group."""
    out_dir = tmp_path_factory.mktemp("tp2")
    models = {parallel: make_model(parallel=parallel) for parallel in (True, False)}  # recurrent parts perturbed
    ref_sds = {k: {n: v.clone() for n, v in m.state_dict().items()} for k, m in models.items()}
    # (spawned, not forked: a forked child inherits a process group an earlier test of this pytest process left open)
    spawn_workers(_worker, 2, models, str(out_dir))
    return dict(models=models, ref_sds=ref_sds, out_dir=out_dir)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("parallel", [True, False])
def test_tp2_equals_tp1(tp_runs, parallel):
    model, ref_sd = tp_runs["models"][parallel], tp_runs["ref_sds"][parallel]
    ref_logits, ref_decoded = _run(model, _inputs())
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    res = [torch.load(tp_runs["out_dir"] / f"{parallel}_rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["info"]["tp_rank"] for r in res] == [0, 1]
    assert all(r["info"]["tp_size"] == 2 and r["info"]["dp_size"] == 1 and r["info"]["dp_rank"] == 0 for r in res)
    assert all(r["info"]["src"] == 0 for r in res)
    assert all(r["n_heads"] == model.config.num_attention_heads // 2 for r in res)
    for r in res:
        assert _rel(r["logits"], ref_logits) <= 1e-5
        assert _rel(r["decoded"], ref_decoded) <= 1e-5
    assert set(res[0]["grads"]) == set(ref_grads)
    for name, ref in ref_grads.items():
        g0, dim = res[0]["grads"][name]
        g1, _ = res[1]["grads"][name]
        full = g0 if dim is None else torch.cat([g0, g1], dim=dim)
        if dim is None:  # replicated parameters get the same gradient on both ranks
            assert _rel(g1, ref) <= 1e-5, name
        assert full.shape == ref.shape, name
        assert _rel(full, ref) <= 1e-5, name
    for k, v in ref_sd.items():
        assert torch.equal(res[0]["sd"][k], v), k


def test_tp_must_divide_heads():
    model = make_model(perturb=False)  # 4 heads
    mesh = ParallelMesh(world_size=3, rank=0, tp_size=3, dp_size=1, tp_rank=0, dp_rank=0)
    with pytest.raises(ValueError, match=r"parallel.tp: 3 does not divide the model's 4 attention heads"):
        apply_tensor_parallel(model, mesh)


def test_trivial_mesh_and_mpu_without_distributed(tp_runs):
    # in a process of its own (an in-process stage earlier in this pytest process may have left a process group): each
    # tp=2 rank of tp_runs ran the case first, before joining its group
    for r in range(2):
        trivial = torch.load(tp_runs["out_dir"] / f"trivial{r}.pt", weights_only=False)
        assert trivial is None, f"rank {r}:\n{trivial}"


def _trivial_mesh_case(rank):
    assert not dist.is_initialized()
    mesh = build_mesh(tp=1)
    assert mesh == trivial_mesh()
    mpu = MeshMPU(mesh)
    assert (mpu.get_model_parallel_world_size(), mpu.get_data_parallel_world_size()) == (1, 1)
    assert mpu.get_pipe_parallel_world_size() == 1
    with pytest.raises(ValueError, match="parallel.tp"):
        build_mesh(tp=2)
    model = make_model(perturb=False)
    ids = _inputs()
    with torch.no_grad():
        before = model(ids).logits
        apply_tensor_parallel(model, mesh)  # tp=1: unchanged
        assert torch.equal(model(ids).logits, before)
