"""The sweep: per-size configs, the recipe per size as Ray tasks, resumability, the table and the plots.

The end-to-end test runs the real recipe (hmscale.recipe.run_recipe) over the 3 miniature flavours
on a local Ray cluster; the others use a stand-in recipe passed as a parameter.
"""

import json
import os
from pathlib import Path

import pytest

from hmscale.atomic import atomic_write_json
from hmscale.teacher.flavors import get_flavor
from scaling.budget import BudgetRule
from scaling.planner import count_params
from scaling.sweep import default_resources, finished_results, run_sweep, size_config, summarize
from scaling.registry import resolve_sizes
from scaling.table import read_csv

MINIS = ["pythia-nano", "pythia-micro", "pythia-mini"]
RECIPE_PRESENT = (Path(__file__).resolve().parents[2] / "hmscale" / "recipe.py").exists()


def standin_recipe(cfg, log=print):
    """Writes results.json like the recipe does; PPL falls with width. Counts its calls."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "calls.txt", "a") as fh:
        fh.write("call\n")
    if cfg.teacher.flavor == "pythia-micro" and os.environ.get("STANDIN_FAIL_MICRO") == "1":
        raise RuntimeError("boom")
    d = get_flavor(cfg.teacher.flavor).d_model
    t = 10 + 2000 / d
    res = {
        "teacher_ppl": t, "hedgehog_ppl": t * 1.3, "hedgemamba_ppl": t * 1.05,
        "stage1": {"tokens": cfg.budget.stage1_tokens, "wall_s": 0.1},
        "stage2": {"tokens": cfg.budget.stage2_tokens, "wall_s": 0.2},
    }
    log("stand-in done")
    atomic_write_json(out / "results.json", res)
    return res


def calls(out, size):
    p = Path(out) / "runs" / size / "calls.txt"
    return len(p.read_text().splitlines()) if p.exists() else 0


def test_size_config(tmp_path):
    cfg = size_config("nano", tmp_path, overrides=["teacher.pretrain_steps=3"])
    assert cfg.teacher.flavor == "pythia-nano" and cfg.teacher.name_or_path is None
    assert cfg.output_dir == str(tmp_path.resolve() / "runs" / "pythia-nano")
    assert cfg.cache.root == str(tmp_path.resolve() / "cache") and cfg.teacher.pretrain_steps == 3
    assert cfg.budget.total_tokens == BudgetRule().miniature_tokens
    # a published size loads its hub id and gets the rule's budget
    big = size_config("410m", tmp_path, rule=BudgetRule(kind="fixed", tokens=5000, split=(0.2, 0.8)))
    assert big.teacher.name_or_path == "EleutherAI/pythia-410m"
    assert big.budget.total_tokens == 5000 and tuple(big.budget.split) == (0.2, 0.8)
    # user settings win over the rule; the same cache root is shared by every size
    c2 = size_config("micro", tmp_path, overrides=["budget.total_tokens=999", "cache.root=/tmp/x"])
    assert c2.budget.total_tokens == 999 and c2.cache.root == "/tmp/x"
    assert default_resources(cfg) == {"num_cpus": 1, "num_gpus": 0}
    for bad in ("teacher.flavor=pythia-mini", "output_dir=/tmp/y"):
        with pytest.raises(ValueError, match="set per size"):
            size_config("nano", tmp_path, overrides=[bad])
    # GPU runs get the planner's layout
    g = size_config("12b", tmp_path, overrides=["parallel.use_gpu=true"])
    assert g.parallel.num_workers > 1 and (g.parallel.tp > 1 or g.parallel.zero_stage == 3) and g.parallel.engine == "ray"
    assert default_resources(g)["num_gpus"] == 0  # the task is a driver; Ray Train workers hold the GPUs
    g1 = size_config("70m", tmp_path, overrides=["parallel.use_gpu=true"])
    assert default_resources(g1) == {"num_cpus": 1, "num_gpus": 1}


def test_summarize_tolerates_nesting():
    s = resolve_sizes("nano")[0]
    cfg = size_config(s, "/tmp/unused-scale")
    row = summarize(s, cfg, {"teacher_ppl": 10.0, "hedgehog_ppl": 12.0, "hedgemamba_ppl": 11.0,
                             "tokens": {"stage1": 100, "stage2": 900}, "wall_s": {"stage1": 1.0, "stage2": 2.0}})
    assert row["gap"] == pytest.approx(1.0) and row["gap_ratio"] == pytest.approx(1.1)
    assert (row["stage1_tokens"], row["stage2_tokens"], row["total_tokens"]) == (100, 900, 1000)
    assert row["wall_s"] == pytest.approx(3.0)


def test_summarize_reads_the_recipe_format():
    """results.json as hmscale.recipe writes it: per-stage records, tokens by stage, wall_seconds."""
    s = resolve_sizes("micro")[0]
    cfg = size_config(s, "/tmp/unused-scale")
    res = {"config_hash": "x", "teacher_ppl": 20.0, "hedgehog_ppl": 30.0, "hedgemamba_ppl": 22.0, "eval_tokens": 252,
           "stages": {"prepare": {"seconds": 1.0, "vocab_size": 512}, "cache": {"seconds": 2.0, "dir": "/c/k"},
                      "stage1": {"seconds": 3.0, "tokens": 410, "summary": {"loss": 0.1}},
                      "stage2": {"seconds": 4.0, "tokens": 3686}, "eval": {"seconds": 0.5}},
           "wall_seconds": 10.5, "tokens": {"stage1": 410, "stage2": 3686}}
    row = summarize(s, cfg, res)
    assert (row["stage1_tokens"], row["stage2_tokens"], row["total_tokens"]) == (410, 3686, 4096)
    assert row["wall_s"] == 10.5 and row["wall_cache_s"] == 2.0 and row["cache_dir"] == "/c/k"
    assert row["gap"] == pytest.approx(2.0) and row["params"] == count_params("pythia-micro", 512)
    assert not any(k.startswith("r_stages") for k in row)


def test_partial_results_are_not_finished(tmp_path):
    p = tmp_path / "results.json"
    assert finished_results(p) is None
    p.write_text(json.dumps({"stages": {"prepare": {"seconds": 1}}}))
    assert finished_results(p) is None
    p.write_text(json.dumps({"hedgemamba_ppl": 3.0, "stages": {}}))
    assert finished_results(p)["hedgemamba_ppl"] == 3.0


def test_local_sweep_resumes_and_records_failures(tmp_path, monkeypatch):
    out = tmp_path / "scale"
    monkeypatch.setenv("STANDIN_FAIL_MICRO", "1")
    rows = run_sweep(MINIS, out, engine="local", recipe=standin_recipe, log=lambda *a: None)
    assert [r["status"] for r in rows] == ["done", "failed", "done"]
    assert "boom" in rows[1]["error"]
    monkeypatch.setenv("STANDIN_FAIL_MICRO", "0")
    rows = run_sweep(MINIS, out, engine="local", recipe=standin_recipe, log=lambda *a: None)
    assert [r["status"] for r in rows] == ["skipped", "done", "skipped"]
    assert [calls(out, s) for s in MINIS] == [1, 2, 1]
    table = read_csv(out / "results.csv")
    assert [r["size"] for r in table] == MINIS and all(float(r["gap"]) > 0 for r in table)
    assert json.loads((out / "results.json").read_text())[0]["teacher_ppl"] > 0


def _check_outputs(out, rows):
    assert [r["size"] for r in rows] == MINIS
    table = read_csv(out / "results.csv")
    assert [r["size"] for r in table] == MINIS
    for r in table:
        for k in ("teacher_ppl", "hedgemamba_ppl", "gap", "total_tokens", "wall_s", "params"):
            assert r[k] not in ("", None), (r["size"], k)
    assert json.loads((out / "results.json").read_text())[2]["size"] == "pythia-mini"
    for name in ("ppl_vs_params", "gap_vs_tokens", "projected_cost"):
        png = out / "plots" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000


@pytest.mark.ray
def test_functions_holding_print_still_travel_after_worker_logs(ray_cluster):
    """Ray's driver swaps builtins.print when it first relays a worker's log line (its tqdm_ray bar manager), and
    then a recipe sent by value that holds print (``log=print``) cannot be pickled ("not the same object as
    builtins.print": the stand-in sweep test failed so once, after another test's workers had printed).
    hmscale.ray_cluster.connect turns that swap off: the bar manager made, print is still print, and such a
    function still runs as a task."""
    import builtins
    import io

    from ray.experimental import tqdm_ray

    ray = ray_cluster
    original = builtins.print
    tqdm_ray.instance()  # what the driver's log relay calls on a worker's first line
    assert builtins.print is original

    @ray.remote
    def call(fn):
        return fn({"name": "x"}, log=lambda *a: None)

    assert ray.get(call.remote(standin_with_print)) == "x"
    buf = io.StringIO()
    standin_with_print({"name": "y"}, log=lambda *a: print(*a, file=buf))
    assert buf.getvalue() == "y\n"


def standin_with_print(cfg, log=print):
    log(cfg["name"])
    return cfg["name"]


@pytest.mark.ray
def test_ray_sweep_with_standin(tmp_path, ray_cluster):
    out = tmp_path / "scale"
    rows = run_sweep(MINIS, out, recipe=standin_recipe, warm_data=False, log=lambda *a: None)
    assert [r["status"] for r in rows] == ["done"] * 3
    _check_outputs(out, rows)
    rows = run_sweep(MINIS, out, recipe=standin_recipe, warm_data=False, log=lambda *a: None)
    assert [r["status"] for r in rows] == ["skipped"] * 3
    assert [calls(out, s) for s in MINIS] == [1, 1, 1]


# tiny budgets: the whole 3-size sweep must stay well under 3 minutes on 2 shared cores (1,024 tokens: one stage-1 and
# three stage-2 steps a size, which is all the assertions need; 4,096 cost pythia-mini, the longest task, 3 s more)
TINY = [
    "teacher.pretrain_steps=5", "teacher.pretrain_seconds=10", "teacher.pretrain_batch_size=4",
    "tokenizer.vocab_size=512",
    "data.seq_len=64", "data.sequences_per_shard=16", "data.max_documents=20",
    "budget.total_tokens=1024",
    "stage1.micro_batch_size=4", "stage1.warmup_steps=1",
    "stage2.micro_batch_size=4", "stage2.warmup_steps=1", "stage2.eval_every=1000",
    "eval.max_sequences=4", "eval.generate_tokens=0",
    "cache.workers=1",
]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not RECIPE_PRESENT, reason="hmscale/recipe.py (run_recipe) has not landed yet; this runs the real recipe once it does")
def test_real_recipe_sweep_on_ray_end_to_end(tmp_path, ray_cluster):
    """3 miniature flavours, the real recipe per size as Ray tasks; rerunning skips every size."""
    import time

    from ray_jobs.scaling import main as job_main

    out = tmp_path / "scale"
    t0 = time.time()
    rows = run_sweep(MINIS, out, overrides=TINY)
    assert [r["status"] for r in rows] == ["done"] * 3, [(r["size"], r["error"]) for r in rows]
    _check_outputs(out, rows)
    for r in rows:
        assert (Path(r["run_dir"]) / "results.json").exists()
        assert 1 < r["teacher_ppl"] < 1e4 and 1 < r["hedgemamba_ppl"] < 1e5
    first = time.time() - t0
    # the rerun (through the job entry point) skips every finished size
    mtimes = {s: (out / "runs" / s / "results.json").stat().st_mtime for s in MINIS}
    t1 = time.time()
    rc = job_main(["--sizes", "nano,micro", "mini", "--out", str(out), *sum((["--set", o] for o in TINY), [])])
    assert rc == 0
    again = json.loads((out / "results.json").read_text())
    assert [r["status"] for r in again] == ["skipped"] * 3
    assert {s: (out / "runs" / s / "results.json").stat().st_mtime for s in MINIS} == mtimes
    assert time.time() - t1 < 60  # nothing ran again (the first pass took `first` seconds)
    print(f"first pass {first:.0f} s, rerun {time.time() - t1:.1f} s")
    # every size's teacher cache lives under the one shared root, one entry per teacher
    root = out / "cache"
    assert all(Path(r["cache_dir"]).parent == root for r in rows)
    assert len({r["cache_dir"] for r in rows}) == 3
    # another study pointed at the same roots shares the teacher and its cache instead of rebuilding
    entries = sorted(p.name for p in root.iterdir())
    other = run_sweep(["nano"], tmp_path / "other", overrides=TINY + [f"cache.root={root}", f"data.cache_dir={out / 'data-cache'}"])
    assert other[0]["status"] == "done" and other[0]["cache_dir"] == rows[0]["cache_dir"]
    assert sorted(p.name for p in root.iterdir()) == entries


def test_job_entry_rejects_bad_input(tmp_path, capsys):
    from ray_jobs.scaling import main as job_main

    assert job_main(["--sizes", "13b", "--out", str(tmp_path), "--local"]) == 2
    assert "unknown size" in capsys.readouterr().err
    assert job_main(["--sizes", "nano", "--out", str(tmp_path), "--local", "--set", "stage2.lr=-1"]) == 2


def test_cli_scale_run_reports_bad_input(tmp_path):
    from typer.testing import CliRunner

    from hmscale.cli import app

    res = CliRunner().invoke(app, ["scale", "run", "--sizes", "nano", "--out", str(tmp_path), "--local", "-s", "stage2.lr=-1"])
    assert res.exit_code == 2 and "stage2.lr" in res.output


# --------------------------------------------------------------------------- run identity: skip only the same run


def identity_recipe(cfg, log=print):
    """The recipe's run-directory bookkeeping without the work: hmscale.recipe's own identity test (it refuses a
    directory holding a run of other training settings), config.yaml, results.json with the key and an eval record."""
    from hmscale.config import save_resolved
    from hmscale.recipe import _load_results
    from hmscale.run_identity import eval_hash

    cfg = cfg.with_absolute_paths()
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    results = _load_results(run_dir, cfg)
    save_resolved(cfg, run_dir)
    with open(run_dir / "calls.txt", "a") as fh:
        fh.write("call\n")
    results.update(teacher_ppl=10.0, hedgehog_ppl=13.0, hedgemamba_ppl=10.5 + cfg.budget.total_tokens / 1e6)
    results["stages"]["eval"] = {"seconds": 0.1, "eval_hash": eval_hash(cfg)}
    atomic_write_json(run_dir / "results.json", results)
    return results


def _sweep(out, *overrides, recipe=identity_recipe):
    return run_sweep(["nano"], out, overrides=["budget.total_tokens=20000", *overrides], engine="local",
                     recipe=recipe, plots=False, log=lambda *a: None)


def test_rerun_with_other_training_settings_stops_naming_them(tmp_path):
    """A finished size rerun with budget.total_tokens=30000 (was 20000) was skipped and its old
    results written as `skipped`. Now the study stops before any work, naming the setting and what to do."""
    out = tmp_path / "scale"
    assert _sweep(out)[0]["status"] == "done"
    table, sweep_json = (out / "results.csv").read_text(), (out / "sweep.json").read_text()
    with pytest.raises(ValueError) as err:
        _sweep(out, "budget.total_tokens=30000")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("pythia-nano: ")
    assert "budget.total_tokens: 20000 -> 30000" in msg and "holds a finished run of a different config" in msg
    assert "another --out" in msg and f"delete {out.resolve() / 'runs' / 'pythia-nano'}" in msg
    assert calls(out, "pythia-nano") == 1  # nothing ran, nothing was overwritten
    assert (out / "results.csv").read_text() == table and (out / "sweep.json").read_text() == sweep_json
    # the recipe itself agrees: it refuses that directory for those settings
    from hmscale.recipe import RecipeError

    cfg = size_config("nano", out, overrides=["budget.total_tokens=30000"])
    with pytest.raises(RecipeError, match="budget.total_tokens: 20000 -> 30000"):
        identity_recipe(cfg)
    # the same settings are still skipped; so are placement-only changes (where things are kept, how work is placed)
    assert _sweep(out)[0]["status"] == "skipped"
    assert _sweep(out, "cache.workers=2", "parallel.checkpoint_every=7")[0]["status"] == "skipped"
    assert calls(out, "pythia-nano") == 1


def test_rerun_with_other_settings_stops_before_any_size_runs(tmp_path):
    """One mismatched size stops the whole study before the others run (no half-updated table)."""
    out = tmp_path / "scale"
    run_sweep(["nano"], out, overrides=["seed=1"], engine="local", recipe=identity_recipe, plots=False, log=lambda *a: None)
    with pytest.raises(ValueError, match=r"pythia-nano: .*\(seed: 1 -> 2\)"):
        run_sweep(["micro", "nano"], out, overrides=["seed=2"], engine="local", recipe=identity_recipe, plots=False,
                  log=lambda *a: None)
    assert calls(out, "pythia-micro") == 0


def test_part_way_run_of_other_settings_is_refused_up_front(tmp_path):
    """A size that stopped part-way under other settings: the recipe would refuse it; the sweep says so first."""
    out = tmp_path / "scale"
    cfg = size_config("nano", out, overrides=["budget.total_tokens=20000"]).with_absolute_paths()
    from hmscale.config import save_resolved
    from hmscale.run_identity import training_hash

    run_dir = Path(cfg.output_dir)
    save_resolved(cfg, run_dir)
    atomic_write_json(run_dir / "results.json", {"config_hash": training_hash(cfg), "stages": {"prepare": {"seconds": 1}}})
    with pytest.raises(ValueError, match=r"holds a run of a different config \(budget.total_tokens: 20000 -> 30000\)"):
        _sweep(out, "budget.total_tokens=30000")
    assert _sweep(out)[0]["status"] == "done"  # the same settings resume it
    assert calls(out, "pythia-nano") == 1


def test_run_that_cannot_be_matched_is_refused(tmp_path):
    """results.json without a key and without config.yaml (as the recipe: it cannot be matched, so no reuse)."""
    out = tmp_path / "scale"
    run_dir = out / "runs" / "pythia-nano"
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps({"teacher_ppl": 1.0, "hedgehog_ppl": 1.0, "hedgemamba_ppl": 1.0}))
    with pytest.raises(ValueError, match="config.yaml is missing or unreadable, so it cannot be matched.*another --out"):
        _sweep(out)


def test_run_keyed_by_an_older_hmscale_is_still_skipped(tmp_path):
    """A finished run whose key was computed the old way (the whole config tree) from its config.yaml, with the
    same training settings: the recipe would take it as the same run, so the sweep skips it."""
    import yaml

    from hmscale.data.cachedir import stable_hash

    out = tmp_path / "scale"
    _sweep(out)
    run_dir = out / "runs" / "pythia-nano"
    tree = yaml.safe_load((run_dir / "config.yaml").read_text())
    res = json.loads((run_dir / "results.json").read_text())
    atomic_write_json(run_dir / "results.json", {**res, "config_hash": stable_hash(tree)})
    assert _sweep(out)[0]["status"] == "skipped"
    atomic_write_json(run_dir / "results.json", {**res, "config_hash": "not-a-key-of-this-config"})
    with pytest.raises(ValueError, match=r"holds a finished run of a different config \(its key does not match its config.yaml\); use another --out"):
        _sweep(out)


def test_changed_evaluation_settings_rerun_the_size(tmp_path):
    """eval.* is not part of a run's identity, but the recipe evaluates again when it changed: no stale numbers."""
    out = tmp_path / "scale"
    _sweep(out)
    rows = _sweep(out, "eval.max_sequences=3")
    assert rows[0]["status"] == "done" and calls(out, "pythia-nano") == 2
    assert _sweep(out, "eval.max_sequences=3")[0]["status"] == "skipped"


def test_recipe_without_run_identity_stays_resumable(tmp_path):
    """A recipe that writes no key nor config.yaml (the stand-in): the sweep adds them, so a rerun still skips the
    size with the same settings and refuses it with others."""
    out = tmp_path / "scale"
    assert _sweep(out, recipe=standin_recipe)[0]["status"] == "done"
    run_dir = out / "runs" / "pythia-nano"
    assert "config_hash" in json.loads((run_dir / "results.json").read_text()) and (run_dir / "config.yaml").exists()
    assert _sweep(out, recipe=standin_recipe)[0]["status"] == "skipped"
    with pytest.raises(ValueError, match="budget.total_tokens: 20000 -> 30000"):
        _sweep(out, "budget.total_tokens=30000", recipe=standin_recipe)


def test_job_entry_stops_on_other_settings_with_one_line(tmp_path, capsys):
    from ray_jobs.scaling import main as job_main

    out = tmp_path / "scale"
    _sweep(out)
    base = ["--sizes", "nano", "--out", str(out), "--local", "--no-plots", "--recipe", "tests.scaling.test_sweep:identity_recipe"]
    capsys.readouterr()
    assert job_main([*base, "--set", "budget.total_tokens=20000"]) == 0
    capsys.readouterr()
    assert job_main([*base, "--set", "budget.total_tokens=30000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "budget.total_tokens: 20000 -> 30000" in err[0] and "another --out" in err[0]


@pytest.mark.parametrize("split, says", [("50/60", "--split: '50/60' read as percentages"), ("abc", "--split: 'abc' is not two numbers")])
def test_job_entry_checks_the_split(tmp_path, capsys, split, says):
    from ray_jobs.scaling import main as job_main

    assert job_main(["--sizes", "nano", "--out", str(tmp_path), "--local", "--split", split]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
    assert job_main(["--sizes", "nano", "--out", str(tmp_path), "--local", "--budget-fraction", "0"]) == 2
    assert "--budget-fraction: 0.0 must be positive" in capsys.readouterr().err


def test_size_directory_with_only_a_config_of_other_settings_is_refused(tmp_path):
    """A size killed before the recipe's first record leaves config.yaml without results.json: config.yaml alone
    says which run it is, as the recipe decides."""
    from hmscale.config import save_resolved
    from scaling.sweep import size_mismatch

    old = size_config("nano", tmp_path, overrides=["budget.total_tokens=20000"])
    save_resolved(old.with_absolute_paths(), old.output_dir)
    new = size_config("nano", tmp_path, overrides=["budget.total_tokens=30000"])
    assert "(budget.total_tokens: 20000 -> 30000)" in size_mismatch("pythia-nano", new)
    assert size_mismatch("pythia-nano", old) is None


def test_job_entry_reads_its_config_as_the_cli_does(tmp_path, capsys):
    """--config goes through hmscale.config.read_config_tree: a missing file, a directory or a non-mapping is one line."""
    from ray_jobs.scaling import main as job_main

    (tmp_path / "list.yaml").write_text("- 1\n")
    for path, says in [(tmp_path / "none.yaml", "does not exist"), (tmp_path, "is a directory"),
                       (tmp_path / "list.yaml", "the top level must be a mapping")]:
        assert job_main(["--sizes", "nano", "--out", str(tmp_path / "o"), "--local", "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("hmscale: error: config file") and says in err[0]
