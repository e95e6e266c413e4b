"""A size whose final evaluation gave a non-finite perplexity is finished: a rerun skips it.

A diverged student evaluates to NaN or inf perplexity; the recipe records that evaluation and skips it on a rerun.
The sweep counted only finite numbers as "the final evaluation", so every rerun of the study sent that size again
(the recipe loading its data and teacher only to skip every stage) and called it "done" each time."""

import json
import math
from pathlib import Path

import pytest

from scaling.sweep import finished_results, run_sweep
from tests.scaling.test_sweep import calls, identity_recipe


def diverged_recipe(cfg, log=print):
    results = identity_recipe(cfg, log)
    results["hedgemamba_ppl"] = float(cfg.seed and "inf" or "nan")
    path = Path(cfg.with_absolute_paths().output_dir) / "results.json"
    path.write_text(json.dumps(results))  # (json writes NaN / Infinity, as the recipe's results.json would hold them)
    return results


@pytest.mark.parametrize("seed", [0, 1])  # NaN, inf
def test_non_finite_final_perplexity_is_finished(tmp_path, seed):
    out = tmp_path / "scale"
    kw = dict(overrides=["budget.total_tokens=20000", f"seed={seed}"], engine="local", recipe=diverged_recipe,
              plots=False, log=lambda *a: None)
    assert run_sweep(["nano"], out, **kw)[0]["status"] == "done"
    stored = json.loads((out / "runs" / "pythia-nano" / "results.json").read_text())["hedgemamba_ppl"]
    assert not math.isfinite(stored) and finished_results(out / "runs" / "pythia-nano" / "results.json") is not None
    rows = run_sweep(["nano"], out, **kw)
    assert rows[0]["status"] == "skipped" and calls(out, "pythia-nano") == 1
    assert rows[0]["gap"] is None and rows[0]["teacher_ppl"] == 10.0  # no number made up for the gap


def test_a_results_file_without_the_final_evaluation_is_still_unfinished(tmp_path):
    p = tmp_path / "results.json"
    for partial in ({"stages": {"prepare": {"seconds": 1}}}, {"hedgemamba_ppl": None}, {"hedgemamba_ppl": "n/a"},
                    {"hedgemamba_ppl": True}):
        p.write_text(json.dumps(partial))
        assert finished_results(p) is None, partial
