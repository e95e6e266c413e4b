"""A multi-process job for the train tests: `python tests/train/dist_job.py SPEC.json` run once per rank
(RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment). SPEC: {"runs": [{"overrides": [...],
"run_dir": ...}], "out": path}. Each run trains stage 2 of a tiny HedgeMamba (converted from a seeded
random pythia-nano teacher) on seeded random tokens; rank 0 writes the per-step losses to `out`."""

import json
import os
import sys

import numpy as np
import torch

torch.set_num_threads(1)
os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")


def tiny_student(seed=0, vocab=96):
    from transformers import GPTNeoXForCausalLM

    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    teacher = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval()
    student = to_hedgehog(teacher)
    with torch.no_grad():  # a non-trivial phi, as after stage 1
        for fm in student.feature_maps:
            fm.weight.add_(0.05 * torch.randn_like(fm.weight))
    return student


def tokens(n=64, L=32, vocab=96, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, size=(n, L))


def run_one(run: dict):
    """One run of a SPEC: stage 1's per-step per-layer losses, or stage 2's per-step losses. A one-rank launch's
    result is this, called in the test's own process (its one-process group: tests/train/test_stage1_layers.py)."""
    from hmscale.config import build_config
    from hmscale.train.data import ArraySource
    from hmscale.train.stage2 import run_stage2

    cfg = build_config({}, run["overrides"])
    if run.get("stage") == "stage1":  # online stage 1 on a seeded random teacher; per-layer losses
        from hmscale.train.engine import read_metrics
        from hmscale.train.stage1 import run_stage1

        run_stage1(cfg, run["run_dir"], teacher=tiny_student().teacher, source=ArraySource(tokens()), resume=False)
        recs = read_metrics(os.path.join(run["run_dir"], "stage1", "metrics.jsonl"))
        return [[r[k] for k in sorted(r) if k.startswith("layer_loss/")] for r in recs]
    out = run_stage2(cfg, run["run_dir"], student=tiny_student(), source=ArraySource(tokens()), resume=False,
                     export=run.get("export", False))
    return out["losses"]


def main():
    spec = json.loads(open(sys.argv[1]).read())
    results = [run_one(run) for run in spec["runs"]]
    if int(os.environ["RANK"]) == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
