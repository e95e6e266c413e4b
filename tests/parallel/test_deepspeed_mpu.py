"""DeepSpeed takes the mesh's mpu: ZeRO-2 with tp=2 (two gloo processes) sees the true gradient norm
(replicated parameters counted once) and trains like the unsharded model."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_hedgemamba import make_model  # noqa: E402

from hmscale.parallel import MeshMPU, apply_tensor_parallel, build_mesh, gather_tensor_parallel_state_dict  # noqa: E402

pytest.importorskip("deepspeed")

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
    "gradient_clipping": 1e9,
}


def _ids():
    return torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(5))


def _worker(rank, model, out_dir):
    torch.set_num_threads(1)
    import deepspeed

    from hmscale.train.engine import init_distributed

    init_distributed(use_gpu=False)  # gloo, without DeepSpeed's inference-only shared-memory op (a g++ build)
    try:
        mesh = build_mesh(tp=2)
        apply_tensor_parallel(model, mesh)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                          config=DS_CONFIG, mpu=MeshMPU(mesh))
        losses, norms = [], []
        for _ in range(2):
            loss = engine(_ids(), labels=_ids()).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            norms.append(float(engine.get_global_grad_norm()))
        sd = gather_tensor_parallel_state_dict(engine.module, mesh)
        if rank == 0:
            torch.save(dict(losses=losses, norms=norms, sd=sd), Path(out_dir) / "ds.pt")
    finally:
        dist.destroy_process_group()


def test_deepspeed_zero2_with_tp2_matches_unsharded(tmp_path):
    from hmscale.train.launch import spawn_workers

    model = make_model()
    # (spawned, not forked: a forked child inherits a process group an earlier test of this pytest process left open)
    spawn_workers(_worker, 2, model, str(tmp_path))
    res = torch.load(tmp_path / "ds.pt", weights_only=False)
    # the same two steps, unsharded, plain PyTorch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses, norms = [], []
    for _ in range(2):
        opt.zero_grad()
        loss = model(_ids(), labels=_ids()).loss
        loss.backward()
        norms.append(float(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))))
        opt.step()
        losses.append(float(loss.detach()))
    assert res["losses"] == pytest.approx(losses, rel=1e-5)
    assert res["norms"] == pytest.approx(norms, rel=1e-4)
    # Adam divides by sqrt(v): entries with near-zero gradients amplify rounding, so compare against the step size
    for k, v in model.state_dict().items():
        torch.testing.assert_close(res["sd"][k], v, rtol=1e-4, atol=2e-2 * DS_CONFIG["optimizer"]["params"]["lr"])
