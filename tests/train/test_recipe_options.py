"""Recipe options: stage-1 epochs over a fixed token share, stage-2 KD from the live teacher, ce_weight."""

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hmscale.config import build_config
from hmscale.train.data import ArraySource, Sampler, SubsetSource, token_share
from hmscale.train.engine import TrainingError, read_metrics

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")

VOCAB, L = 96, 32


def tiny_teacher(seed=0, sharpen=1.0):
    """A random pythia-nano; `sharpen` scales its output embedding (a random model's predictions are
    nearly uniform: a student matches them whatever its attention does)."""
    from transformers import GPTNeoXForCausalLM

    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=VOCAB)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    return model


def toks(n=48):
    return np.random.default_rng(1).integers(0, VOCAB, size=(n, L))


class RecordingSource(ArraySource):
    """An ArraySource that remembers which rows were fetched."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self.seen: list[int] = []

    def fetch(self, ids):
        self.seen.extend(int(i) for i in ids)
        return super().fetch(ids)


# ---------------------------------------------------------------- token share


def test_token_share_is_what_one_pass_reads_first():
    src = ArraySource(toks(40))
    share = token_share(src, tokens=10 * L - 5, seed=3)  # ceil -> 10 rows
    assert isinstance(share, SubsetSource) and share.num_sequences == 10 and share.seq_len == L
    first = Sampler(40, seed=3).ids(0, 10)
    np.testing.assert_array_equal(share.ids, first)
    np.testing.assert_array_equal(share.fetch(np.arange(10))["input_ids"].numpy(), src.tokens[first])
    assert token_share(src, tokens=40 * L, seed=3) is None  # the whole source: no subset
    with pytest.raises(ValueError, match="ids must lie"):
        SubsetSource(src, [0, 40])


def test_stage1_epochs_revisit_the_share_only(tmp_path):
    from hmscale.train.stage1 import run_stage1

    common = ["stage1.source=online", "stage1.micro_batch_size=4", "stage1.lr=0.05", "stage1.warmup_steps=1",
              "budget.total_tokens=1280", "budget.split=[0.5,0.5]", "parallel.zero_stage=1"]  # share: 640 tokens = 20 rows
    teacher = tiny_teacher()
    one_src, three_src = RecordingSource(toks()), RecordingSource(toks())
    one = run_stage1(build_config({}, common), tmp_path / "one", teacher=teacher, source=one_src, export=False)
    three = run_stage1(build_config({}, common + ["stage1.epochs=3"]), tmp_path / "three", teacher=teacher,
                       source=three_src, export=False)
    assert one["total_steps"] == 5 and three["total_steps"] == 15
    share = set(one_src.seen)
    assert len(share) == 20 and set(three_src.seen) == share  # the same 20 rows, no new tokens
    counts = np.bincount(three_src.seen)
    assert sorted(set(counts[list(share)])) == [3]  # each row once per pass
    # later passes keep lowering the layer-local loss
    assert np.mean(three["losses"][-5:]) < np.mean(one["losses"][-5:])


def test_stage2_epochs_revisit_the_share_only(tmp_path):
    from hmscale.models.convert import to_hedgehog
    from hmscale.train.stage2 import run_stage2

    common = ["stage2.micro_batch_size=4", "stage2.warmup_steps=1", "budget.total_tokens=1280",
              "budget.split=[0.5,0.5]", "parallel.zero_stage=1", "stage2.eval_every=1000"]  # share: 20 rows
    one_src, two_src = RecordingSource(toks()), RecordingSource(toks())
    one = run_stage2(build_config({}, common), tmp_path / "one", student=to_hedgehog(tiny_teacher()),
                     source=one_src, export=False)
    two = run_stage2(build_config({}, common + ["stage2.epochs=2"]), tmp_path / "two",
                     student=to_hedgehog(tiny_teacher()), source=two_src, export=False)
    assert one["total_steps"] == 5 and two["total_steps"] == 10
    share = set(one_src.seen)
    assert len(share) == 20 and set(two_src.seen) == share  # the same 20 rows, no new tokens
    counts = np.bincount(two_src.seen)
    assert sorted(set(counts[list(share)])) == [2]  # each row once per pass
    assert two_src.seen[:20] != two_src.seen[20:]  # reshuffled for the second pass


def test_stage1_min_lr_ratio_sets_the_floor(tmp_path):
    from hmscale.train.stage1 import run_stage1

    cfg = build_config({}, ["stage1.source=online", "stage1.micro_batch_size=4", "stage1.steps=4", "stage1.lr=0.05",
                            "stage1.warmup_steps=0", "stage1.min_lr_ratio=0.5", "parallel.zero_stage=1"])
    run_stage1(cfg, tmp_path, teacher=tiny_teacher(), source=ArraySource(toks()), export=False)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "stage1" / "metrics.jsonl") if "lr" in r]
    # each line logs the lr its step trained at: the full lr first (no warmup), then the cosine towards 0.5 x lr,
    # which it reaches at step 4, the first after the stage
    from hmscale.train.engine import lr_multiplier

    assert len(lrs) == 4 and lrs[0] == pytest.approx(0.05)
    assert lrs == pytest.approx([0.05 * lr_multiplier(s, 0, 4, 0.5) for s in range(4)])
    assert all(a > b > 0.025 for a, b in zip(lrs, lrs[1:]))


# ---------------------------------------------------------------- online KD


def test_online_kd_loss_is_the_full_vocab_kl():
    from hmscale.train.stage2 import causal_lm_losses

    torch.manual_seed(0)
    b, l, V, T = 3, 17, 50, 2.0
    z = torch.randn(b, l, V, requires_grad=True)
    t = torch.randn(b, l, V)
    x = torch.randint(0, V, (b, l))
    loss, ex = causal_lm_losses(z, x, {}, 0.7, T, ce_weight=0.25, teacher_logits=t)
    (g,) = torch.autograd.grad(loss, z)
    ce = F.cross_entropy(z[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
    kl = F.kl_div(torch.log_softmax(z[:, :-1] / T, -1).reshape(-1, V), torch.log_softmax(t[:, :-1] / T, -1).reshape(-1, V),
                  log_target=True, reduction="batchmean") * T * T
    (g_ref,) = torch.autograd.grad(0.25 * ce + 0.7 * kl, z)
    torch.testing.assert_close(loss, 0.25 * ce + 0.7 * kl)
    torch.testing.assert_close(ex["kd"], kl.detach())
    torch.testing.assert_close(g, g_ref)
    # the teacher's own logits: no KD left
    _, ex0 = causal_lm_losses(t, x, {}, 1.0, T, teacher_logits=t)
    assert float(ex0["kd"]) < 1e-5


def test_kd_without_targets_is_a_clear_error():
    from hmscale.train.stage2 import causal_lm_losses

    with pytest.raises(TrainingError, match="kd_source=online"):
        causal_lm_losses(torch.randn(1, 4, 8), torch.zeros(1, 4, dtype=torch.long), {}, 1.0)


def _perturbed_student(teacher, seed=1, noise=0.2):
    """HedgeMamba converted from `teacher`, with noise on its MLPs (so it starts away from the teacher)."""
    from hmscale.models.convert import to_hedgehog, to_hedgemamba

    model = to_hedgemamba(to_hedgehog(teacher))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mlp" in name and p.ndim == 2:
                p.add_(noise * torch.randn(p.shape, generator=gen))
    return model


def test_stage2_online_kd_matches_the_live_teacher(tmp_path):
    import copy

    from hmscale.train.data import BatchPlan, get_batch
    from hmscale.train.stage2 import run_stage2

    teacher = tiny_teacher(sharpen=10.0)
    cfg = build_config({}, ["stage2.steps=8", "stage2.micro_batch_size=4", "stage2.warmup_steps=1", "stage2.lr=3e-3",
                            "stage2.kd_source=online", "stage2.kd_weight=1.0", "stage2.ce_weight=0",
                            "parallel.zero_stage=1"])
    data = toks()
    model = _perturbed_student(teacher)
    start = copy.deepcopy(model).eval()
    res = run_stage2(cfg, tmp_path, model=model, teacher=teacher, source=ArraySource(data), export=False)
    rec = [r for r in read_metrics(tmp_path / "stage2" / "metrics.jsonl") if r.get("kind") == "train"]
    assert all("kd" in r and "ce" in r for r in rec) and res["done"]
    # KD only: the optimised loss is the KL to the teacher, and it falls
    assert rec[0]["loss"] == pytest.approx(rec[0]["kd"], rel=1e-5)
    assert np.mean([r["kd"] for r in rec[-3:]]) < 0.7 * rec[0]["kd"]
    # step 0's KD is KL(teacher || student) on step 0's rows
    batch = get_batch(ArraySource(data), Sampler(len(data), seed=cfg.seed + 2), BatchPlan(4, 1, 0, 1), 0, 0, "cpu")
    with torch.no_grad():
        s = torch.log_softmax(start(input_ids=batch["input_ids"]).logits[:, :-1].float(), -1)
        t = torch.log_softmax(teacher(input_ids=batch["input_ids"]).logits[:, :-1].float(), -1)
    kl = float((t.exp() * (t - s)).sum(-1).mean())
    assert kl > 0.05 and rec[0]["kd"] == pytest.approx(kl, rel=1e-4)


def test_stage2_online_kd_uses_the_stage1_students_teacher(tmp_path):
    from hmscale.models.convert import to_hedgehog
    from hmscale.train.stage2 import run_stage2

    cfg = build_config({}, ["stage2.steps=2", "stage2.micro_batch_size=4", "stage2.kd_source=online",
                            "stage2.kd_weight=0.5", "parallel.zero_stage=1"])
    res = run_stage2(cfg, tmp_path, student=to_hedgehog(tiny_teacher()), source=ArraySource(toks()), export=False)
    rec = [r for r in read_metrics(tmp_path / "stage2" / "metrics.jsonl") if r.get("kind") == "train"]
    assert res["done"] and all(r["loss"] == pytest.approx(r["ce"] + 0.5 * r["kd"], rel=1e-5) for r in rec)


def test_stage2_online_kd_needs_a_teacher(tmp_path):
    from hmscale.models.convert import to_hedgehog, to_hedgemamba
    from hmscale.train.stage2 import run_stage2

    cfg = build_config({}, ["stage2.steps=2", "stage2.micro_batch_size=4", "stage2.kd_source=online",
                            "stage2.kd_weight=1.0", "parallel.zero_stage=1"])
    model = to_hedgemamba(to_hedgehog(tiny_teacher()))
    with pytest.raises(TrainingError, match="needs the teacher"):
        run_stage2(cfg, tmp_path, model=model, source=ArraySource(toks()), export=False)


# ---------------------------------------------------------------- lr scales of the added parts


def test_param_groups_split_teacher_weights_added_parts_and_feature_maps():
    from hmscale.config import ComponentsConfig
    from hmscale.models.convert import to_hedgehog, to_hedgemamba
    from hmscale.train.stage2 import freeze_embeddings, param_groups

    model = to_hedgemamba(to_hedgehog(tiny_teacher()))
    freeze_embeddings(model)
    assert param_groups(model, 1e-3) == [p for p in model.parameters() if p.requires_grad]
    groups = {g["name"]: g for g in param_groups(model, 1e-3, new_scale=10, feature_map_scale=30)}
    assert groups["base"]["lr"] == 1e-3 and groups["new"]["lr"] == pytest.approx(1e-2)
    assert groups["feature_map"]["lr"] == pytest.approx(3e-2)
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = {k: {names[id(p)].split("mixer.")[-1] for p in g["params"]} for k, g in groups.items()}
    assert kinds["new"] == {"conv.weight", "conv.bias", "dt_proj.weight", "dt_proj.bias", "A_log", "A_scale", "D",
                            "z_proj.weight", "z_proj.bias"}
    assert kinds["feature_map"] == {"feature_map.weight", "feature_map.bias"}
    assert "in_proj.weight" in kinds["base"] and "lm_head.weight" in kinds["base"]
    total = sum(len(g["params"]) for g in groups.values())
    assert total == sum(1 for p in model.parameters() if p.requires_grad)  # every trainable parameter, once
    # no added parts (the Hedgehog-only ablation): the same config trains the teacher's weights and phi
    bare = to_hedgemamba(to_hedgehog(tiny_teacher()), ComponentsConfig(gate=False, conv=False, ssm=False))
    freeze_embeddings(bare)
    bare_groups = param_groups(bare, 1e-3, new_scale=10, feature_map_scale=30)
    assert [g["name"] for g in bare_groups] == ["base", "feature_map"]
    assert sum(len(g["params"]) for g in bare_groups) == sum(1 for p in bare.parameters() if p.requires_grad)


def test_stage2_trains_the_groups_at_their_lr(tmp_path, monkeypatch):
    from hmscale.models.convert import to_hedgehog
    from hmscale.train import stage2

    seen = {}
    real = stage2.build_engine

    def spy(*a, **k):
        seen["engine"] = real(*a, **k)
        return seen["engine"]

    monkeypatch.setattr(stage2, "build_engine", spy)
    cfg = build_config({}, ["stage2.steps=2", "stage2.micro_batch_size=4", "stage2.warmup_steps=0", "stage2.lr=1e-3",
                            "stage2.min_lr_ratio=1.0", "stage2.new_params_lr_scale=10",
                            "stage2.feature_map_lr_scale=30", "parallel.zero_stage=2"])
    stage2.run_stage2(cfg, tmp_path, student=to_hedgehog(tiny_teacher()), source=ArraySource(toks()), export=False)
    lrs = {g["name"]: g["lr"] for g in seen["engine"].optimizer.param_groups}
    assert lrs == pytest.approx({"base": 1e-3, "new": 1e-2, "feature_map": 3e-2})


def test_stage2_trainable_mixers_moves_only_the_mixers(tmp_path):
    """stage2.trainable=mixers: the loss falls, the mixers' weights move, every other weight stays the
    teacher's (bitwise); a model without mixers is a clear error."""
    import copy

    from hmscale.train.stage2 import freeze_all_but_mixers, run_stage2

    teacher = tiny_teacher(sharpen=10.0)
    cfg = build_config({}, ["stage2.steps=8", "stage2.micro_batch_size=4", "stage2.warmup_steps=1", "stage2.lr=3e-3",
                            "stage2.trainable=mixers", "stage2.kd_source=online", "stage2.kd_weight=1.0",
                            "stage2.ce_weight=0", "parallel.zero_stage=2"])
    model = _perturbed_student(teacher)
    start = {n: p.detach().clone() for n, p in copy.deepcopy(model).named_parameters()}
    res = run_stage2(cfg, tmp_path, model=model, teacher=teacher, source=ArraySource(toks()), export=False)
    rec = [r for r in read_metrics(tmp_path / "stage2" / "metrics.jsonl") if r.get("kind") == "train"]
    # the MLPs carry noise the frozen weights keep: the mixers can only make up part of it
    assert res["done"] and np.mean([r["kd"] for r in rec[-3:]]) < 0.97 * rec[0]["kd"]
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach().cpu(), start[n])}
    assert moved and all(".mixer." in n for n in moved)
    assert any("in_proj" in n for n in moved) and any("feature_map" in n for n in moved)
    with pytest.raises(TrainingError, match="no '.mixer.' parameters"):
        freeze_all_but_mixers(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------- hidden-state alignment


def test_hidden_alignment_is_a_relative_mse_over_the_inner_layers():
    from hmscale.train.stage2 import hidden_alignment

    torch.manual_seed(0)
    t = [torch.randn(2, 5, 8) * (i + 1) for i in range(5)]  # embeddings, 3 inner layers, the final (normed) one
    assert float(hidden_alignment([x.clone() for x in t], t)) == 0.0
    s = [x.clone() for x in t]
    s[0] += 10.0
    s[-1] += 10.0  # the embeddings and the last state are not compared
    assert float(hidden_alignment(s, t)) == 0.0
    s[2] = t[2] + 0.1 * torch.randn_like(t[2])
    want = ((s[2] - t[2]) ** 2).sum(-1).mean() / (t[2] ** 2).sum(-1).mean() / 3
    torch.testing.assert_close(hidden_alignment(s, t), want)
    # invariant to the scale of the residual stream
    torch.testing.assert_close(hidden_alignment([3 * x for x in s], [3 * x for x in t]), want)
    with pytest.raises(TrainingError, match="hidden_weight"):
        hidden_alignment(s[:-1], t)


def test_stage2_hidden_alignment_term_is_logged_and_falls(tmp_path):
    from hmscale.train.stage2 import run_stage2

    teacher = tiny_teacher()
    cfg = build_config({}, ["stage2.steps=8", "stage2.micro_batch_size=4", "stage2.warmup_steps=1", "stage2.lr=3e-3",
                            "stage2.hidden_weight=2.0", "parallel.zero_stage=1"])
    res = run_stage2(cfg, tmp_path, model=_perturbed_student(teacher), teacher=teacher, source=ArraySource(toks()),
                     export=False)
    rec = [r for r in read_metrics(tmp_path / "stage2" / "metrics.jsonl") if r.get("kind") == "train"]
    assert res["done"] and all("hidden" in r for r in rec)
    assert all(r["loss"] == pytest.approx(r["ce"] + 2.0 * r["hidden"], rel=1e-4) for r in rec)
    assert rec[0]["hidden"] > 0.01 and np.mean([r["hidden"] for r in rec[-3:]]) < 0.8 * rec[0]["hidden"]


def test_stage2_can_train_on_the_hidden_alignment_alone(tmp_path):
    """ce_weight = kd_weight = 0 with hidden_weight > 0 is a loss (the hidden-state alignment alone): it was refused
    as "no loss"; the logged loss is the weighted alignment term, and with nothing at all the config still refuses."""
    from hmscale.config import ConfigError
    from hmscale.train.stage2 import run_stage2

    teacher = tiny_teacher()
    cfg = build_config({}, ["stage2.steps=4", "stage2.micro_batch_size=4", "stage2.warmup_steps=1", "stage2.lr=3e-3",
                            "stage2.ce_weight=0", "stage2.hidden_weight=2.0", "parallel.zero_stage=1"])
    res = run_stage2(cfg, tmp_path, model=_perturbed_student(teacher), teacher=teacher, source=ArraySource(toks()),
                     export=False)
    rec = [r for r in read_metrics(tmp_path / "stage2" / "metrics.jsonl") if r.get("kind") == "train"]
    assert res["done"] and len(rec) == 4
    assert all(r["loss"] == pytest.approx(2.0 * r["hidden"], rel=1e-5) for r in rec)
    with pytest.raises((ConfigError, ValueError), match="leaves no loss"):
        build_config({}, ["stage2.ce_weight=0"])
