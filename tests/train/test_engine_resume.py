"""Engine: DeepSpeed configs, schedule, NaN stop, metrics; resume reproduces the uninterrupted run (world 1)."""

import json
import os

import numpy as np
import pytest
import torch
from torch import nn

from hmscale.config import build_config
from hmscale.train.data import ArraySource
from hmscale.train.engine import DS_CONFIG_DIR, NonFiniteLoss, OptimSpec, ds_config_for, lr_multiplier, read_metrics

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")


def rel_err(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def tiny_student(seed=0, vocab=96):
    from transformers import GPTNeoXForCausalLM

    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    teacher = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval()
    return teacher, to_hedgehog(teacher)


def toks(n=48, L=32, vocab=96):
    return np.random.default_rng(1).integers(0, vocab, size=(n, L))


# ---------------------------------------------------------------- configs + schedule


@pytest.mark.parametrize("name", ["zero1.json", "zero2.json", "zero3.json", "zero3_offload.json"])
def test_ds_configs_have_real_values(name):
    text = (DS_CONFIG_DIR / name).read_text()
    assert '"auto"' not in text
    spec = OptimSpec(lr=2e-4, micro_batch_size=3, grad_accum=5, grad_clip=0.5, zero_stage=2, bf16=True,
                     ds_config=str(DS_CONFIG_DIR / name))
    conf = ds_config_for(spec, dp_world=4)
    assert conf["train_micro_batch_size_per_gpu"] == 3 and conf["gradient_accumulation_steps"] == 5
    assert conf["train_batch_size"] == 60 and conf["gradient_clipping"] == 0.5
    assert conf["optimizer"]["params"]["lr"] == 2e-4 and conf["bf16"]["enabled"] is True
    assert conf["zero_optimization"]["stage"] == json.loads(text)["zero_optimization"]["stage"]


def test_the_files_bf16_options_survive_the_recipe(tmp_path):
    """The recipe sets bf16.enabled; the file's other bf16 keys (e.g. DeepSpeed's check_grad_overflow) are kept."""
    conf = json.loads((DS_CONFIG_DIR / "zero2.json").read_text())
    conf["bf16"] = {"enabled": False, "check_grad_overflow": False}
    path = tmp_path / "zero2_no_overflow_check.json"
    path.write_text(json.dumps(conf))
    out = ds_config_for(OptimSpec(lr=1e-3, micro_batch_size=2, bf16=True, ds_config=str(path)), 1)
    assert out["bf16"] == {"enabled": True, "check_grad_overflow": False}


def test_default_config_follows_zero_stage():
    for z in (0, 1, 2, 3):
        assert ds_config_for(OptimSpec(lr=1e-3, micro_batch_size=2, zero_stage=z), 1)["zero_optimization"]["stage"] == z


def test_lr_schedule_warmup_then_cosine():
    m = [lr_multiplier(s, warmup=4, total=20, min_ratio=0.1) for s in range(25)]
    assert m[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(m[3:], m[4:]))
    assert m[20] == pytest.approx(0.1) and m[24] == pytest.approx(0.1)


# ---------------------------------------------------------------- resume


def _cfg(extra=()):
    return build_config({}, ["stage1.steps=6", "stage1.micro_batch_size=4", "stage1.lr=0.05", "stage1.warmup_steps=1",
                             "stage2.steps=6", "stage2.micro_batch_size=4", "stage2.warmup_steps=2", "stage2.lr=3e-3",
                             "parallel.checkpoint_every=3", "parallel.zero_stage=2", *extra])


@pytest.mark.parametrize("adam, gpu", [
    ("auto", False),  # torch's foreach Adam on CPU
    ("fused", False),  # torch's fused AdamW, handed to DeepSpeed (the GPU default)
    pytest.param("auto", True, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a GPU")]),
])
def test_stage2_resume_reproduces_losses(tmp_path, adam, gpu):
    from hmscale.train.stage2 import run_stage2

    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _cfg([f"parallel.adam={adam}", f"parallel.use_gpu={str(gpu).lower()}"])
    full = run_stage2(cfg, tmp_path / "full", student=tiny_student()[1], source=ArraySource(toks()), resume=False,
                      export=False)
    part = run_stage2(cfg, tmp_path / "cut", student=tiny_student()[1], source=ArraySource(toks()), stop_at_step=3,
                      export=False)
    assert part["end_step"] == 3 and not part["done"]
    assert (tmp_path / "cut" / "stage2" / "checkpoints" / "step_00000003" / "meta.json").exists()
    # a fresh process would rebuild the model from scratch: so do we (weights come from the checkpoint)
    rest = run_stage2(cfg, tmp_path / "cut", student=tiny_student(seed=5)[1], source=ArraySource(toks()))
    assert rest["start_step"] == 3 and rest["done"]
    # the summary counts the whole stage: the first attempt's tokens and seconds too
    assert rest["tokens"] == full["tokens"] == 6 * 4 * 32 and rest["seconds"] > part["seconds"] > 0
    resumed = part["losses"] + rest["losses"]
    assert len(resumed) == len(full["losses"]) == 6
    # (on a GPU the SSD backward's partial sums may reduce in another order: 1e-5 there)
    assert rel_err(resumed, full["losses"]) <= (1e-5 if gpu else 1e-6), (resumed, full["losses"])
    # metrics.jsonl of the resumed run reads as one run; the HF export loads
    steps = [r["step"] for r in read_metrics(tmp_path / "cut" / "stage2" / "metrics.jsonl")]
    assert steps == list(range(6))
    from transformers import AutoModelForCausalLM

    import hmscale.models  # noqa: F401

    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "cut" / "stage2" / "hf"))
    assert m(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.shape[-1] == 96
    # resumed at its last checkpoint (as after a kill between that checkpoint and the summary): no step to train, and
    # still the stage's tokens, seconds and final loss, not this call's nothing
    again = run_stage2(cfg, tmp_path / "cut", student=tiny_student(seed=5)[1], source=ArraySource(toks()), export=False)
    assert again["start_step"] == 6 and again["done"] and again["losses"] == []
    assert again["tokens"] == full["tokens"] and again["final_loss"] == rest["final_loss"]
    ckpts = tmp_path / "cut" / "stage2" / "checkpoints"
    meta3, meta6 = (json.loads((ckpts / f"step_0000000{k}" / "meta.json").read_text()) for k in (3, 6))
    assert meta3["stage_tokens"] == 3 * 4 * 32 and meta6["stage_tokens"] == full["tokens"]
    assert 0 < meta3["stage_seconds"] < meta6["stage_seconds"] <= again["seconds"] <= rest["seconds"]


def test_stage1_online_resume_and_export(tmp_path):
    from hmscale.train.stage1 import load_stage1_student, run_stage1

    cfg = _cfg(["stage1.source=online"])
    teacher = tiny_student()[0]
    full = run_stage1(cfg, tmp_path / "full", teacher=teacher, source=ArraySource(toks()), resume=False)
    part = run_stage1(cfg, tmp_path / "cut", teacher=teacher, source=ArraySource(toks()), stop_at_step=3)
    rest = run_stage1(cfg, tmp_path / "cut", teacher=teacher, source=ArraySource(toks()))
    resumed = part["losses"] + rest["losses"]
    assert rel_err(resumed, full["losses"]) <= 1e-6
    rec = read_metrics(tmp_path / "full" / "stage1" / "metrics.jsonl")
    assert {"layer_loss/0", "layer_loss/1"} <= set(rec[0])
    # exported student: feature maps + teacher reference, loads back to the same phi
    sdir = tmp_path / "cut" / "stage1" / "student"
    assert (sdir / "feature_maps.safetensors").exists() and json.loads((sdir / "student.json").read_text())["teacher"]
    back = load_stage1_student(tmp_path / "cut")
    ref = rest["student_model"]
    for a, b in zip(back.feature_maps.parameters(), ref.feature_maps.parameters()):
        torch.testing.assert_close(a, b)


def test_stage1_zero3_matches_zero2_and_exports_full_maps(tmp_path):
    from hmscale.train.stage1 import run_stage1

    teacher = tiny_student()[0]
    out = {}
    for z in (2, 3):
        cfg = _cfg(["stage1.source=online", "stage1.steps=3", f"parallel.zero_stage={z}"])
        out[z] = run_stage1(cfg, tmp_path / f"z{z}", teacher=teacher, source=ArraySource(toks()))
    assert rel_err(out[3]["losses"], out[2]["losses"]) <= 1e-5
    for a, b in zip(out[3]["student_model"].feature_maps.parameters(), out[2]["student_model"].feature_maps.parameters()):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- NaN / inf


class _Out:
    def __init__(self, logits):
        self.logits = logits


class PoisonedLM(nn.Module):
    """A tiny causal LM whose logits turn NaN on its `bad_call`-th forward (None: never)."""

    def __init__(self, vocab=96, bad_call=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)
        self.calls, self.bad_call = 0, bad_call

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids):
        self.calls += 1
        logits = self.head(self.emb(input_ids))
        if self.calls == self.bad_call:
            logits = logits * float("nan")
        return _Out(logits)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    from hmscale.train.stage2 import run_stage2

    cfg = _cfg(["parallel.checkpoint_every=2", "stage2.steps=8"])
    with pytest.raises(NonFiniteLoss) as err:
        run_stage2(cfg, tmp_path, model=PoisonedLM(bad_call=6), source=ArraySource(toks()), export=False)
    msg = str(err.value)
    assert "\n" not in msg and "step 5" in msg and "step_00000004" in msg, msg
    assert "lower the learning rate (a new output_dir" in msg
    ck = sorted(p.name for p in (tmp_path / "stage2" / "checkpoints").iterdir())
    assert ck == ["step_00000002", "step_00000004"]
    assert [r["step"] for r in read_metrics(tmp_path / "stage2" / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_rowwise_checkpointed_losses_equal_the_plain_ones():
    import torch.nn.functional as F

    from hmscale.train.stage2 import causal_lm_losses

    torch.manual_seed(0)
    b, l, V, k, T = 3, 17, 50, 5, 2.0
    z = torch.randn(b, l, V, requires_grad=True)
    x = torch.randint(0, V, (b, l))
    batch = {"topk_ids": torch.randint(0, V, (b, l, k)), "topk_logprobs": torch.randn(b, l, k).log_softmax(-1)}
    loss, ex = causal_lm_losses(z, x, batch, 0.5, T)
    (g,) = torch.autograd.grad(loss, z)
    lg = z[:, :-1]
    ce = F.cross_entropy(lg.reshape(-1, V), x[:, 1:].reshape(-1))
    p = torch.softmax(batch["topk_logprobs"][:, :-1] / T, -1)
    kd = -(p * torch.log_softmax(lg / T, -1).gather(-1, batch["topk_ids"][:, :-1])).sum(-1).mean() * T * T
    (g_ref,) = torch.autograd.grad(ce + 0.5 * kd, z)
    torch.testing.assert_close(loss, ce + 0.5 * kd)
    torch.testing.assert_close(ex["ce"], ce.detach())
    torch.testing.assert_close(ex["kd"], kd.detach())
    torch.testing.assert_close(g, g_ref)


# ---------------------------------------------------------------- a ds_config file's own ZeRO stage


def test_the_zero_stage_run_is_the_files_stage(tmp_path):
    def zero(stage, ds_config):
        over = [f"parallel.zero_stage={stage}"] + ([f"parallel.ds_config={ds_config}"] if ds_config else [])
        return build_config({}, over).parallel.zero

    assert zero(2, None) == 2 and zero(0, None) == 0
    assert zero(2, str(DS_CONFIG_DIR / "zero3_offload.json")) == 3
    assert zero(3, str(DS_CONFIG_DIR / "zero1.json")) == 1
    conf = json.loads((DS_CONFIG_DIR / "zero2.json").read_text())
    del conf["zero_optimization"]["stage"]
    (tmp_path / "nostage.json").write_text(json.dumps(conf))
    assert zero(1, str(tmp_path / "nostage.json")) == 1  # the file names none: parallel.zero_stage


def test_tp_with_a_zero3_ds_config_is_one_line_before_joining(tmp_path):
    """The file makes DeepSpeed run ZeRO-3 whatever parallel.zero_stage says: the config refuses tp with it
    (tests/test_config.py), and so does the layout for a tp given to it directly, before joining the group."""
    from hmscale.train.common import setup_layout
    from hmscale.train.engine import TrainingError

    cfg = build_config({}, ["parallel.num_workers=2", f"parallel.ds_config={DS_CONFIG_DIR / 'zero3_offload.json'}"])
    with pytest.raises(TrainingError) as err:
        setup_layout(cfg, tp=2)
    msg = str(err.value)
    assert "\n" not in msg and "ZeRO 3" in msg and "zero3_offload.json" in msg, msg


def test_stage2_export_gathers_a_zero3_ds_config_run(tmp_path):
    """parallel.ds_config=zero3.json with parallel.zero_stage left at 2 runs ZeRO-3: the export gathers the
    partitioned weights (it saved the frozen embeddings as empty tensors: the model did not load)."""
    from transformers import AutoModelForCausalLM

    import hmscale.models  # noqa: F401
    from hmscale.train.stage2 import run_stage2

    teacher, student = tiny_student(seed=3)
    emb = teacher.get_input_embeddings().weight.detach().clone()
    cfg = _cfg(["stage2.steps=2", f"parallel.ds_config={DS_CONFIG_DIR / 'zero3.json'}"])
    res = run_stage2(cfg, tmp_path, student=student, source=ArraySource(toks()))
    m = AutoModelForCausalLM.from_pretrained(res["hf"])
    torch.testing.assert_close(m.get_input_embeddings().weight, emb)  # frozen in stage 2: the teacher's
    assert all(p.numel() > 0 for p in m.parameters())
    assert torch.isfinite(m(input_ids=torch.as_tensor(toks(2, 8))).logits).all()
    assert res["done"] and res["zero_stage"] == 3  # the summary names the stage that ran


def test_logged_lr_is_the_lr_each_step_trained_at(tmp_path):
    """metrics.jsonl's lr of step s is the schedule's lr at s (it logged s + 1's: the scheduler had stepped),
    in a resumed run too; the schedule itself (what the optimizer used) is unchanged."""
    from hmscale.train.engine import lr_multiplier
    from hmscale.train.stage2 import run_stage2

    warmup, steps, lr, floor = 3, 7, 2e-3, 0.25
    cfg = _cfg([f"stage2.steps={steps}", f"stage2.warmup_steps={warmup}", f"stage2.lr={lr}",
                f"stage2.min_lr_ratio={floor}", "parallel.checkpoint_every=2"])
    want = [lr * lr_multiplier(s, warmup, steps, floor) for s in range(steps)]
    run_stage2(cfg, tmp_path, student=tiny_student()[1], source=ArraySource(toks()), stop_at_step=3, export=False)
    run_stage2(cfg, tmp_path, student=tiny_student(seed=4)[1], source=ArraySource(toks()), export=False)
    recs = read_metrics(tmp_path / "stage2" / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(steps))
    assert [r["lr"] for r in recs] == pytest.approx(want, rel=1e-6)
    assert recs[warmup - 1]["lr"] == pytest.approx(lr)  # the warmup's last step is at the full lr


def test_ctrl_c_says_where_the_stage_stands_and_resumes(tmp_path, capsys):
    """Ctrl-C mid-stage: the KeyboardInterrupt goes on up (exit 130) after one line naming the checkpoint a rerun
    resumes from (the run used to end silently); the rerun finishes with the uninterrupted run's losses."""
    from hmscale.train.stage2 import run_stage2

    cfg = _cfg(["stage2.steps=7", "parallel.checkpoint_every=2"])
    full = run_stage2(cfg, tmp_path / "full", student=tiny_student()[1], source=ArraySource(toks()), export=False)

    def ctrl_c(step):
        if step == 5:
            raise KeyboardInterrupt

    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        run_stage2(cfg, tmp_path / "cut", student=tiny_student()[1], source=ArraySource(toks()), export=False,
                   fault_hook=ctrl_c)
    lines = [l for l in capsys.readouterr().err.splitlines() if "interrupted" in l]
    assert len(lines) == 1, lines
    assert "after 5 of 7 steps" in lines[0] and lines[0].endswith("step_00000004"), lines[0]
    rest = run_stage2(cfg, tmp_path / "cut", student=tiny_student(seed=5)[1], source=ArraySource(toks()), export=False)
    assert rest["start_step"] == 4 and rest["done"]
    recs = read_metrics(tmp_path / "cut" / "stage2" / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(7))  # step 4, logged before the interrupt, once
    assert rel_err([r["loss"] for r in recs], full["losses"]) <= 1e-6


def test_metrics_lines_keep_counts_and_flags(tmp_path):
    """The JSONL keeps an event's ints and bools (they were written 60.0 and 1.0) and floats as floats."""
    from hmscale.train.engine import MetricsLogger

    rng = np.random.default_rng(7)
    n, flag, x = int(rng.integers(10, 10**9)), bool(rng.integers(0, 2)), float(rng.normal())
    log = MetricsLogger(tmp_path, "t", 3, progress=False, tensorboard=False)
    log.log(0, {"event": "start", "total_steps": n, "layer_parallel": flag, "mode": "cache"}, kind="event")
    log.log(0, {"loss": x, "np": np.float32(x), "t": torch.tensor(x)})
    log.close()
    ev, tr = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert ev["total_steps"] == n and type(ev["total_steps"]) is int
    assert ev["layer_parallel"] is flag and ev["mode"] == "cache"
    assert tr["loss"] == x and type(tr["np"]) is float and tr["t"] == pytest.approx(x)


def test_a_killed_saves_leftovers_go_with_the_next_checkpoint(tmp_path):
    """A kill during a save leaves a step directory without meta.json; a rerun with another checkpoint_every never
    rewrites that step, so it stayed beside the keep_checkpoints complete ones for good."""
    from hmscale.train.stage2 import run_stage2

    ckpts = tmp_path / "stage2" / "checkpoints"
    rng = np.random.default_rng(11)
    odd = [int(s) for s in rng.choice(np.arange(1, 12, 2), size=2, replace=False)]
    for s in odd:  # half-written: DeepSpeed's files, no meta.json
        (ckpts / f"step_{s:08d}" / "state").mkdir(parents=True)
        (ckpts / f"step_{s:08d}" / "state" / "mp_rank_00_model_states.pt").write_bytes(rng.bytes(64))
    (ckpts / "step_00000099").mkdir()  # a later step's directory is not this save's to judge
    cfg = _cfg(["stage2.steps=12", "parallel.checkpoint_every=4", "parallel.keep_checkpoints=2"])
    res = run_stage2(cfg, tmp_path, student=tiny_student()[1], source=ArraySource(toks()), export=False)
    assert res["done"] and res["start_step"] == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000008", "step_00000012", "step_00000099"]


def test_grad_clip_zero_turns_clipping_off(tmp_path):
    """stage2.grad_clip=0 trains without clipping (DeepSpeed's 0): the losses of a norm bound no gradient reaches;
    a tight bound changes them."""
    from hmscale.train.stage2 import run_stage2

    runs = {}
    for clip in ("0", "1e9", "1e-3"):
        cfg = _cfg([f"stage2.grad_clip={clip}", "stage2.steps=4"])
        runs[clip] = run_stage2(cfg, tmp_path / clip, student=tiny_student()[1], source=ArraySource(toks()),
                                resume=False, export=False)["losses"]
    assert rel_err(runs["0"], runs["1e9"]) <= 1e-6, runs
    assert rel_err(runs["1e-3"][1:], runs["0"][1:]) > 1e-4, runs


def test_a_warmup_longer_than_the_stage_is_warned():
    from hmscale.train.engine import warmup_note

    note = warmup_note(OptimSpec(lr=2e-3, micro_batch_size=2, warmup_steps=10, total_steps=1))
    assert note.startswith("[train] warning: warmup_steps=10 is longer than the stage's 1 steps")
    assert "the lr peaks at 10% of lr=0.002" in note
    assert "peaks at 75%" in warmup_note(OptimSpec(lr=1e-3, micro_batch_size=2, warmup_steps=4, total_steps=3))
    assert warmup_note(OptimSpec(lr=1e-3, micro_batch_size=2, warmup_steps=4, total_steps=4)) is None
    assert warmup_note(OptimSpec(lr=1e-3, micro_batch_size=2, warmup_steps=0, total_steps=1)) is None
