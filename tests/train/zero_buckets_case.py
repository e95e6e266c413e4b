"""The case of tests/train/test_zero_buckets.py: the model, the engines and the comparison. Run as a script it is
one rank of the two-rank comparison (tests/train/conftest.py's ``launch``, fresh interpreters: a forked pytest
process would inherit the one-rank process group of earlier tests): ``python zero_buckets_case.py SPEC.json``
with SPEC {"stage", "config", "out"} and RANK / WORLD_SIZE / MASTER_* in the environment."""

import json
import sys
from pathlib import Path

import torch
from torch import nn

from hmscale.train import zero_buckets
from hmscale.train.engine import OptimSpec, build_engine


class Mixed(nn.Module):
    """Linear layers with per-feature scales, a tiny tensor and one wide layer (1,088 elements > the bucket)."""

    def __init__(self, layers=5, d=16, tiny=3):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d)) for _ in range(layers))
        self.wide = nn.Linear(d, 4 * d)
        self.tiny = nn.Parameter(torch.randn(tiny))  # 3: 2,531 elements in all, an odd count (alignment padding)

    def forward(self, x):
        for lin, s in zip(self.lins, self.scales):
            x = torch.tanh(lin(x)) * s
        return (self.wide(x).sum(-1) * self.tiny.sum()).pow(2).mean()


def ds_config(tmp: Path, stage: int, **zero) -> str:
    """ds_configs/zero{stage}.json with 300-element buckets (and ``zero`` overrides), written under ``tmp``."""
    conf = json.loads((Path(__file__).resolve().parents[2] / "ds_configs" / f"zero{stage}.json").read_text())
    conf["zero_optimization"].update(reduce_bucket_size=300, allgather_bucket_size=300, **zero)
    path = Path(tmp) / f"zero{stage}_small_buckets{'_' + '_'.join(zero) if zero else ''}.json"
    path.write_text(json.dumps(conf))
    return str(path)


def engine(stage, bucketed, config, dp_world=1, tiny=3):
    torch.manual_seed(0)
    spec = OptimSpec(lr=3e-2, micro_batch_size=4, grad_accum=2, total_steps=20, zero_stage=stage, grad_clip=0.05,
                     adam="foreach", ds_config=config)
    return build_engine(Mixed(tiny=tiny), spec, dp_world=dp_world, grad_buckets=bucketed)


def train(eng, steps, rank=0):
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(steps * eng.gradient_accumulation_steps()):
        loss = eng(torch.randn(4, 16, generator=g))
        eng.backward(loss)
        eng.step()  # an optimizer step at every second call (the accumulation boundary)
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in eng.module.parameters()]


def compare(stage, config, dp_world=1, rank=0, tiny=3):
    """Four optimizer steps with the bucketed path and with DeepSpeed's: losses, parameters, last grad norms."""
    ours = engine(stage, True, config, dp_world, tiny)
    assert ours.optimizer.reduce_ipg_grads.__func__ is zero_buckets.flush_buckets  # installed
    theirs = engine(stage, False, config, dp_world, tiny)
    assert theirs.optimizer.reduce_ipg_grads.__func__ is type(theirs.optimizer).reduce_ipg_grads
    lo, po = train(ours, 4, rank)
    lt, pt = train(theirs, 4, rank)
    return dict(lo=lo, lt=lt, po=po, pt=pt, no=float(ours.get_global_grad_norm()),
                nt=float(theirs.get_global_grad_norm()))


def main(spec_path):
    import torch.distributed as dist

    from hmscale.train.engine import init_distributed

    spec = json.loads(Path(spec_path).read_text())
    init_distributed(use_gpu=False)  # gloo, without DeepSpeed's inference-only shared-memory op (a g++ build)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = []
        for case in spec["cases"]:  # (several in one launch: the process start-up is most of a case's time)
            r = compare(case["stage"], case["config"], dp_world=world, rank=rank)
            mine = dict(lo=r["lo"], lt=r["lt"], no=r["no"], nt=r["nt"],
                        same_params=all(torch.equal(a, b) for a, b in zip(r["po"], r["pt"])))
            rows = [None] * world
            dist.all_gather_object(rows, mine)
            flat = torch.cat([p.flatten() for p in r["po"]])
            every = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(every, flat)
            out.append(dict(ranks=rows, params_equal_across_ranks=all(torch.equal(every[0], f) for f in every)))
        if rank == 0:
            Path(spec["out"]).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
