"""`scale run` options are checked before any work, in one line.

Per-size resources were only checked as dicts: a misspelt Ray option, a negative or non-numeric CPU count, or the
task options the sweep sets itself (`max_retries`, `name`) went through, and then failed at submission: after the
embedded Ray cluster had started, the table had been written with every size pending and earlier sizes had been
submitted; a wrong type or a repeated option ended in a TypeError traceback (the job catches ValueError only)."""

import json

import pytest

import scaling.sweep as sweep
from tests.scaling.test_sweep import identity_recipe

KW = dict(overrides=["budget.total_tokens=20000"], recipe=identity_recipe, plots=False, warm_data=False,
          log=lambda *a: None)


class FakeRay:
    """What run_sweep asks of Ray, in-process: remote(fn).options(**opts).remote(*args) runs fn."""

    def __init__(self):
        self.options_seen = []

    def remote(self, fn):
        import ray

        ray_remote = ray.remote(fn)  # Ray's own option checks, as the real submission does them
        fake = self

        class Remote:
            def options(self, **opts):
                ray_remote.options(**opts)
                fake.options_seen.append(opts)
                return type("Task", (), {"remote": staticmethod(lambda *a: Ref(fn, a))})()

        return Remote()

    def wait(self, refs, num_returns=1):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        return ref.fn(*ref.args)


class Ref:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    monkeypatch.setattr(sweep, "_ensure_ray", lambda *a, **k: fake)
    return fake


@pytest.mark.parametrize("resources, cpus, says", [
    ({"*": {"num_cpus": "two"}}, 1, "num_cpus"),
    ({"nano": {"num_gpu": 1}}, 1, "num_gpu"),
    ({"micro": {"num_gpus": -1}}, 1, "num_gpus"),
    (None, -2, "num_cpus"),
])
def test_bad_task_options_are_one_line_before_any_work(tmp_path, fake_ray, resources, cpus, says):
    out = tmp_path / "scale"
    with pytest.raises(ValueError) as err:
        sweep.run_sweep(["nano", "micro"], out, resources=resources, cpus_per_size=cpus, **KW)
    msg = str(err.value)
    assert says in msg and "\n" not in msg
    assert fake_ray.options_seen == [] and not (out / "results.csv").exists() and not (out / "sweep.json").exists()


def test_the_users_retry_count_wins_over_the_sweeps_default(tmp_path, fake_ray):
    rows = sweep.run_sweep(["nano"], tmp_path / "scale", resources={"*": {"max_retries": 3}}, **KW)
    assert rows[0]["status"] == "done"
    assert [o["max_retries"] for o in fake_ray.options_seen] == [3]


def test_an_unknown_size_leaves_no_sweep_directory(tmp_path):
    out = tmp_path / "new-study"
    with pytest.raises(ValueError, match="unknown size '13b'"):
        sweep.run_sweep(["nano", "13b"], out, engine="local", **KW)
    assert not out.exists()


def test_job_entry_says_it_in_one_line(tmp_path, capsys, fake_ray):
    from ray_jobs import scaling as job

    assert job.main(["--sizes", "nano", "--out", str(tmp_path / "s"), "--no-plots",
                     "--resources", json.dumps({"nano": {"num_cpus": "two"}})]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hmscale: error: ") and err.count("\n") == 1 and "num_cpus" in err


@pytest.mark.parametrize("n", ["0", "-2"])
def test_job_entry_refuses_an_embedded_cluster_of_no_cpus(tmp_path, capsys, monkeypatch, n):
    """`--num-cpus 0` started a cluster of every core of the machine (0 read as "not given"); `--num-cpus -2` failed
    in ray.init, after sweep.json and a table of pending sizes had been written."""
    from ray_jobs import scaling as job

    monkeypatch.setattr(sweep, "_ensure_ray", lambda *a, **k: pytest.fail("Ray started"))
    out = tmp_path / "s"
    assert job.main(["--sizes", "nano", "--out", str(out), "--no-plots", "--num-cpus", n]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hmscale: error: --num-cpus") and err.count("\n") == 1
    assert not out.exists()


def test_cli_plan_refuses_both_budget_options():
    """`scale plan --tokens N --budget-fraction F` planned N tokens without a word about F (the usage gives them as
    alternatives: --budget-fraction 0.0333 | --tokens N)."""
    from typer.testing import CliRunner

    from hmscale.cli import app

    res = CliRunner().invoke(app, ["scale", "plan", "--sizes", "70m", "--tokens", "1000000", "--budget-fraction", "0.1"])
    assert res.exit_code == 2 and "--tokens" in res.output and "--budget-fraction" in res.output
    assert res.output.count("\n") == 1
    ok = CliRunner().invoke(app, ["scale", "plan", "--sizes", "70m", "--tokens", "1000000"])
    assert ok.exit_code == 0 and "1M" in ok.output
