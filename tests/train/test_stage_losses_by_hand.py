"""Stage 1 / stage 2 against hand computations: the per-layer stage-1 losses are logged as ``layer_loss/<l>`` for
every teacher depth (one layer included), and the cached top-k KD term is the documented formula, whose gradient is
the live-teacher KL's with the teacher restricted to the same top-k (world 1, CPU, fp32)."""

import os

import numpy as np
import torch

from hmscale.config import build_config
from hmscale.train.data import ArraySource
from hmscale.train.engine import read_metrics

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")

VOCAB, L = 96, 32


def _teacher(n_layers: int):
    from transformers import GPTNeoXForCausalLM

    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=VOCAB, num_hidden_layers=n_layers)).eval()


def test_a_one_layer_teacher_logs_its_stage1_loss_as_layer_loss_0(tmp_path):
    """README / stage1.py: `layer_loss/<l>` per layer. With one layer the engine's flattening of a 1-element extra
    logged it as a bare `layer_loss`, which readers of `layer_loss/<l>` (plots, tests, the layer-parallel check)
    did not find."""
    from hmscale.train.stage1 import run_stage1

    teacher = _teacher(1)
    assert teacher.config.num_hidden_layers == 1
    cfg = build_config({}, ["stage1.steps=1", "stage1.micro_batch_size=4", "stage1.source=online",
                            "parallel.zero_stage=2"])
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(8, L))
    run_stage1(cfg, tmp_path, teacher=teacher, source=ArraySource(tokens), export=False)
    (rec,) = read_metrics(tmp_path / "stage1" / "metrics.jsonl")
    assert "layer_loss/0" in rec and "layer_loss" not in rec, rec
    assert rec["layer_loss/0"] == rec["loss"]


def test_cached_topk_kd_is_the_documented_formula_and_has_the_restricted_live_kl_gradient():
    """stage2.py: kd = -T^2 sum_k softmax(lp_teacher/T)_k log_softmax(z/T)[id_k], a token mean next to the CE mean,
    loss = ce_weight ce + kd_weight kd; it differs from the live teacher's T^2 KL restricted to the same top-k by
    the teacher's (constant) entropy term only: the same gradient."""
    from hmscale.train.stage2 import causal_lm_losses

    torch.manual_seed(0)
    b, l, V, K, T = 2, 5, 11, 4, 2.0
    z = torch.randn(b, l, V) * 2
    x = torch.randint(0, V, (b, l))
    t_lp = torch.log_softmax(torch.randn(b, l, V) * 3, -1)
    vals, ids = t_lp.topk(K, -1)
    batch = {"topk_ids": ids, "topk_logprobs": vals}
    loss, ex = causal_lm_losses(z, x, batch, 0.5, T, ce_weight=0.7, fused_ce=False)
    ce = kd = ent = 0.0
    n = b * (l - 1)
    for i in range(b):
        for t in range(l - 1):
            ce += -torch.log_softmax(z[i, t].double(), -1)[x[i, t + 1]]
            p = torch.softmax(vals[i, t].double() / T, -1)
            kd += -(p * torch.log_softmax(z[i, t].double() / T, -1)[ids[i, t]]).sum() * T * T
            ent += -(p * p.log()).sum() * T * T
    assert abs(float(ex["ce"]) - float(ce / n)) < 1e-5
    assert abs(float(ex["kd"]) - float(kd / n)) < 1e-5
    assert abs(float(loss) - float(0.7 * ce / n + 0.5 * kd / n)) < 1e-5
    restricted = torch.full((b, l, V), -1e4).scatter(-1, ids, vals)
    zz = z.clone().requires_grad_(True)
    cached, _ = causal_lm_losses(zz, x, batch, 1.0, T, ce_weight=0.0, fused_ce=False)
    (g_cached,) = torch.autograd.grad(cached, zz)
    live, ex_live = causal_lm_losses(zz, x, {}, 1.0, T, ce_weight=0.0, teacher_logits=restricted, fused_ce=False)
    (g_live,) = torch.autograd.grad(live, zz)
    assert abs(float(ex_live["kd"]) - float(kd / n - ent / n)) < 1e-5
    torch.testing.assert_close(g_cached, g_live, rtol=0, atol=1e-7)
