"""Registry, budget policy and planner: parameter counts, memory, layouts, cache bytes, GPU-hours."""

import json

import pytest

from hmscale.config import build_config
from hmscale.teacher.flavors import PYTHIA, neox_config
from scaling.budget import Budget, BudgetRule, parse_split
from scaling.planner import (
    PlanSettings,
    cache_bytes,
    choose_layout,
    count_params,
    load_throughput,
    plan,
    plan_size,
    student_param_breakdown,
    train_memory,
)
from scaling.registry import PYTHIA_SIZES, canonical_name, resolve_sizes

GB = 1e9


def test_registry_resolves_names_and_groups():
    assert [s.name for s in resolve_sizes(None)] == list(PYTHIA_SIZES) and len(PYTHIA_SIZES) == 8
    assert [s.name for s in resolve_sizes("70m,Pythia-1B,nano")] == ["pythia-70m", "pythia-1b", "pythia-nano"]
    minis = [s.name for s in resolve_sizes(["miniatures", "pythia-micro"])]
    assert minis[:3] == ["pythia-nano", "pythia-micro", "pythia-mini"] and all(not s.startswith("pythia-1") for s in minis)
    assert [s.name for s in resolve_sizes("mini")] == ["pythia-mini"]
    assert canonical_name("12b") == "pythia-12b"
    with pytest.raises(ValueError, match="unknown size"):
        resolve_sizes("13b")
    s = resolve_sizes("1.4b")[0]
    assert s.hub_id == "EleutherAI/pythia-1.4b" and s.describe()["head_dim"] == 128


@pytest.mark.parametrize("name", list(PYTHIA))
def test_param_counts_match_published(name):
    f = PYTHIA[name]
    n = count_params(f)
    assert abs(n - f.published_params) / f.published_params < 0.01, (name, n, f.published_params)


def test_param_count_matches_a_real_model():
    """The formula counts exactly what transformers builds (a miniature, instantiated)."""
    from transformers import GPTNeoXForCausalLM

    for name in ("pythia-nano", "pythia-micro"):
        model = GPTNeoXForCausalLM(neox_config(name))
        assert sum(p.numel() for p in model.parameters()) == count_params(name)


@pytest.mark.parametrize("components", [{}, {"gate": False}, {"conv": False}, {"ssm": False}])
def test_student_param_count_matches_the_real_hedgemamba(components):
    convert = pytest.importorskip("hmscale.models.convert")
    from transformers import GPTNeoXForCausalLM

    teacher = GPTNeoXForCausalLM(neox_config("pythia-micro"))
    model = convert.to_hedgemamba(convert.to_hedgehog(teacher), components=dict(components))
    real = sum(p.numel() for p in model.parameters())
    assert real == student_param_breakdown("pythia-micro", PlanSettings(**components))["total"]


@pytest.mark.parametrize("targets", [("in_proj", "out_proj"), ("in_proj", "z_proj", "dense_h_to_4h", "lm_head")])
def test_lora_counts_match_the_real_stage2_model(targets):
    convert = pytest.importorskip("hmscale.models.convert")
    from types import SimpleNamespace

    from transformers import GPTNeoXForCausalLM

    from hmscale.train.stage2 import apply_stage2_lora

    teacher = GPTNeoXForCausalLM(neox_config("pythia-micro"))
    model = convert.to_hedgemamba(convert.to_hedgehog(teacher))
    apply_stage2_lora(model, SimpleNamespace(lora_targets=list(targets), lora_rank=3, lora_alpha=6.0))
    parts = student_param_breakdown("pythia-micro", PlanSettings(lora_rank=3, lora_targets=targets))
    assert parts["total"] == sum(p.numel() for p in model.parameters())
    assert parts["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert parts["trainable"] < student_param_breakdown("pythia-micro")["trainable"] / 5
    lay = choose_layout("pythia-6.9b", PlanSettings(gpu_mem_gb=80, lora_rank=16))
    assert lay.tp == 1 and choose_layout("pythia-6.9b", PlanSettings(gpu_mem_gb=80)).tp > 1
    with pytest.raises(ValueError, match="LoRA runs with ZeRO data parallelism only"):
        choose_layout("pythia-1b", PlanSettings(lora_rank=8, tp=2))
    with pytest.raises(ValueError, match="LoRA target 'q_proj' unknown"):
        student_param_breakdown("pythia-micro", PlanSettings(lora_rank=3, lora_targets=("q_proj",)))


def test_student_params_add_the_new_parts():
    parts = student_param_breakdown("pythia-1b")
    assert parts["total"] == count_params("pythia-1b") + parts["feature_maps"] + parts["conv"] + parts["gate"] + parts["ssm"]
    assert parts["trainable"] == parts["total"] - parts["embed_in"]
    off = student_param_breakdown("pythia-1b", PlanSettings(gate=False, conv=False, ssm=False))
    assert off["total"] == count_params("pythia-1b") + off["feature_maps"]


def test_memory_follows_zero_and_tp():
    s = PlanSettings()
    base = train_memory("pythia-1.4b", 1, 1, 0, False, s)
    n = student_param_breakdown("pythia-1.4b", s)
    assert base["params"] == pytest.approx(2 * n["total"]) and base["optimizer"] == pytest.approx(12 * n["trainable"])
    z1 = train_memory("pythia-1.4b", 4, 1, 1, False, s)
    z2 = train_memory("pythia-1.4b", 4, 1, 2, False, s)
    z3 = train_memory("pythia-1.4b", 4, 1, 3, False, s)
    assert z1["optimizer"] == pytest.approx(base["optimizer"] / 4) and z1["grads"] == base["grads"]
    assert z2["grads"] == pytest.approx(base["grads"] / 4) and z2["params"] == base["params"]
    assert z3["params"] == pytest.approx(base["params"] / 4)
    tp2 = train_memory("pythia-1.4b", 1, 2, 0, False, s)
    assert tp2["params"] == pytest.approx(base["params"] / 2) and tp2["activations"] < base["activations"]
    ck = train_memory("pythia-1.4b", 1, 1, 0, True, s)
    assert ck["activations"] < base["activations"] / 3
    assert train_memory("pythia-1.4b", 1, 1, 0, False, PlanSettings(micro_batch=8))["activations"] > base["activations"]


def test_layout_small_sizes_use_one_gpu():
    for name in ("pythia-70m", "pythia-410m", "pythia-1b"):
        lay = choose_layout(name)
        assert (lay.dp, lay.tp, lay.zero_stage) == (1, 1, 0)


@pytest.mark.parametrize("name", ["pythia-6.9b", "pythia-12b"])
def test_layout_shards_the_model_when_one_gpu_cannot_hold_it(name):
    s = PlanSettings(gpu_mem_gb=80)
    p = plan_size(name, s)
    assert p.single_gpu_train_gb > 80  # the training state alone does not fit one 80 GB GPU
    assert p.tp > 1 or p.zero_stage == 3
    assert p.gpus > 1 and p.train_mem_gb * GB <= s.usable_bytes
    # nothing smaller fits: every layout on fewer GPUs is over the budget
    for tp in (1, 2, 4, 8):
        for dp in range(1, p.gpus // tp + 1):
            if dp * tp >= p.gpus or PYTHIA[name].n_heads % tp:
                continue
            for z in (0, 1, 2, 3):
                if tp > 1 and z == 3:
                    continue
                assert train_memory(name, dp, tp, z, True, s)["total"] > s.usable_bytes


def test_layout_without_tp_uses_zero3():
    p = plan_size("pythia-12b", PlanSettings(tp=1))
    assert p.zero_stage == 3 and p.dp > 1


def test_bigger_gpu_needs_fewer_gpus():
    assert choose_layout("pythia-12b", PlanSettings(gpu_mem_gb=141)).gpus <= choose_layout("pythia-12b", PlanSettings(gpu_mem_gb=80)).gpus
    with pytest.raises(ValueError, match="does not fit"):
        choose_layout("pythia-12b", PlanSettings(gpu_mem_gb=4, max_gpus=4))


def test_budget_rules():
    f = PYTHIA["pythia-1b"]
    b = BudgetRule().budget(f)
    assert abs(b.total_tokens - 10e9) / 10e9 < 0.01 and b.split == (0.1, 0.9)
    assert b.stage1_tokens + b.stage2_tokens == b.total_tokens
    assert BudgetRule(kind="tokens_per_param", tokens_per_param=2).total_tokens(f) == 2 * count_params(f)
    assert BudgetRule(kind="fixed", tokens=1000).total_tokens(f) == 1000
    assert BudgetRule(fraction=0.5, max_tokens=10).total_tokens(f) == 10
    assert BudgetRule().total_tokens(resolve_sizes("nano")[0].flavor) == 400_000
    assert parse_split("10/90") == pytest.approx((0.1, 0.9)) and parse_split("0.25,0.75") == pytest.approx((0.25, 0.75))
    assert parse_split("0.2/0.8") == pytest.approx((0.2, 0.8)) and parse_split("100/0") == (1.0, 0.0)
    with pytest.raises(ValueError, match="budget.split"):
        BudgetRule(split=(0.5, 0.6))
    # same rounding as the config
    cfg = build_config(overrides=["budget.total_tokens=12345"])
    bb = Budget(12345, (0.1, 0.9))
    assert (bb.stage1_tokens, bb.stage2_tokens) == (cfg.budget.stage1_tokens, cfg.budget.stage2_tokens)


@pytest.mark.parametrize("text", ["50/60", "1,3", "0.3,0.3", "-10/110"])
def test_split_follows_the_config_rule_without_renormalising(text):
    """--split is percentages summing to 100 or fractions summing to 1, by budget.split's own rule (BudgetConfig)."""
    with pytest.raises(ValueError, match=r"^--split: .*summing to 1 \(budget\.split's rule\)") as err:
        parse_split(text)
    assert "\n" not in str(err.value) and "10/90" in str(err.value)
    # what the option accepts is exactly what the config accepts
    with pytest.raises(ValueError):
        build_config(overrides=[f"budget.split=[{text.replace('/', ',')}]"])


@pytest.mark.parametrize("text", ["abc", "10/90/0", "", "nan/1", "10/x"])
def test_split_that_is_not_two_numbers_names_the_option(text):
    with pytest.raises(ValueError, match=r"^--split: .* is not two numbers; write .*10/90") as err:
        parse_split(text)
    assert "could not convert" not in str(err.value)
    assert parse_split("10/90", option="budget rule") == pytest.approx((0.1, 0.9))


def test_forced_tp_follows_the_config_rule():
    """--tp must divide the teacher's heads (RunConfig's rule: what `hmscale check` rejects is not planned)."""
    with pytest.raises(ValueError, match=r"^--tp 3: .*pythia-70m.*does not divide the teacher's 8 heads"):
        choose_layout("pythia-70m", PlanSettings(tp=3))
    with pytest.raises(ValueError, match="parallel.tp"):
        build_config(overrides=["teacher.flavor=pythia-70m", "teacher.name_or_path=EleutherAI/pythia-70m",
                                "parallel.tp=3", "parallel.num_workers=3"])
    assert choose_layout("pythia-160m", PlanSettings(tp=3)).tp == 3  # 12 heads
    assert choose_layout("pythia-nano", PlanSettings(tp=2)).tp == 2  # a miniature: its 4 heads
    with pytest.raises(ValueError, match=r"^--tp 0: "):
        choose_layout("pythia-70m", PlanSettings(tp=0))
    with pytest.raises(ValueError, match=r"^--tp 2 with --zero 3: .*ZeRO 0, 1 or 2"):
        choose_layout("pythia-1b", PlanSettings(tp=2, zero_stage=3))


def test_cache_bytes():
    s = PlanSettings()
    f = PYTHIA["pythia-410m"]
    b = Budget(1_000_000)
    per_token = f.n_layers * 2 * f.d_model * 2 + 8
    assert cache_bytes(f, b, s) == pytest.approx(per_token * b.stage1_tokens)
    half = cache_bytes(f, b, PlanSettings(token_fraction=0.5, capture_bytes=1))
    assert half < cache_bytes(f, b, s) / 3
    assert cache_bytes(f, b, PlanSettings(topk=32)) > cache_bytes(f, b, s)


def test_gpu_hours_from_measured_table(tmp_path):
    table = tmp_path / "tput.json"
    table.write_text(json.dumps({"1b": {"cache": 1000.0, "stage1": 2000.0, "stage2": 500.0}}))
    s = PlanSettings(throughput=load_throughput(table), budget=BudgetRule(kind="fixed", tokens=36_000_000))
    p = plan_size("pythia-1b", s)
    assert p.throughput_source == "measured"
    assert p.gpu_hours["stage1"] == pytest.approx(3.6e6 / 2000 / 3600)
    assert p.gpu_hours["stage2"] == pytest.approx(32.4e6 / 500 / 3600)
    assert p.gpu_hours_total == pytest.approx(sum(p.gpu_hours.values()))
    csvp = tmp_path / "tput.csv"
    csvp.write_text("size,stage,tokens_per_s\npythia-1b,stage2,500\n")
    assert load_throughput(csvp) == {"pythia-1b": {"stage2": 500.0}}
    # the JSON the repo's benchmarks write
    tb, cb = tmp_path / "train.json", tmp_path / "cache.json"
    tb.write_text(json.dumps({"meta": {}, "rows": [{"model": "pythia-160m hedgemamba", "tokens_per_s": 9000.0},
                                                  {"model": "pythia-160m teacher-sdpa", "tokens_per_s": 1.0},
                                                  {"model": "pythia-410m hedgemamba", "error": "out of memory"}]}))
    cb.write_text(json.dumps({"teacher": "pythia-160m", "cache_tok_s": 50000.0}))
    assert load_throughput(tb, cb) == {"pythia-160m": {"stage2": 9000.0, "cache": 50000.0}}
    # the default model: bigger models are slower per token
    plans = plan("70m,1b,12b")
    rates = [p.tokens_per_s["stage2"] for p in plans]
    assert rates == sorted(rates, reverse=True)


def test_cli_plan_writes_table_csv_json(tmp_path):
    from typer.testing import CliRunner

    from hmscale.cli import app

    csvp, jsonp, png = tmp_path / "plan.csv", tmp_path / "plan.json", tmp_path / "cost.png"
    res = CliRunner().invoke(app, ["scale", "plan", "--sizes", "70m,6.9b", "--gpu-mem", "80", "--csv", str(csvp), "--json", str(jsonp), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "pythia-6.9b" in res.output
    rows = json.loads(jsonp.read_text())
    assert [r["size"] for r in rows] == ["pythia-70m", "pythia-6.9b"]
    assert rows[1]["tp"] > 1 or rows[1]["zero_stage"] == 3
    assert csvp.read_text().startswith("size,")
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(app, ["scale", "plan", "--sizes", "13b"])
    assert bad.exit_code == 2


@pytest.mark.parametrize("args, says", [
    (["--sizes", "70m", "--tp", "3"], "--tp 3: not a layout the recipe accepts for pythia-70m (parallel.tp: 3 does not divide the teacher's 8 heads"),
    (["--sizes", "pythia", "--tp", "3"], "for pythia-70m"),  # the first size it does not fit stops the plan
    (["--sizes", "1b", "--tp", "2", "--zero", "3"], "--tp 2 with --zero 3:"),
    (["--sizes", "70m", "--split", "50/60"], "--split: '50/60' read as percentages is the split [0.5, 0.6]"),
    (["--sizes", "70m", "--split", "abc"], "--split: 'abc' is not two numbers"),
    (["--sizes", "70m", "--tokens", "0"], "--tokens: 0 must be positive"),
    (["--sizes", "70m", "--budget-fraction", "0"], "--budget-fraction: 0.0 must be positive"),
])
def test_cli_plan_rejects_what_the_config_rejects(args, says):
    from typer.testing import CliRunner

    from hmscale.cli import app

    res = CliRunner().invoke(app, ["scale", "plan", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hmscale: error: ") and says in lines[0], res.output


def test_activation_estimate_matches_the_h200_measurement():
    """The planner's activation bytes per token vs benchmarks/train_throughput.py on an H200 (within 5 %)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scaling" / "calibration" / "train_throughput_h200_2026-11-29.json"
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) >= 3
    for r in rows:
        name = r["model"].split()[0]
        s = PlanSettings(micro_batch=r["micro_batch"], seq_len=r["seq"])
        est = train_memory(name, 1, 1, 0, False, s)["activations"] / (r["micro_batch"] * r["seq"])
        assert abs(est - r["act_bytes_per_token"]) / r["act_bytes_per_token"] < 0.05, name
        assert abs(student_param_breakdown(name)["total"] - r["params"]) / r["params"] < 1e-3, name
    # the same file works as a measured-throughput table
    assert load_throughput(path)["pythia-1b"]["stage2"] == pytest.approx(rows[2]["tokens_per_s"])
