"""engine=local: the same train function in one process, the real data -> teacher -> cache path,
stage 1 from the cache, stage 2 with KD; the run-dir layout and the HF export; the CLI commands."""

import json
import os

import pytest
import torch

pytestmark = pytest.mark.slow


def _overrides(tmp_path, inputs=None):
    """The run's settings, its output_dir under `tmp_path`; the data directory (tokenizer, tokens, the pretrained
    miniature teacher) and the teacher-cache root under `inputs` (default `tmp_path`): both are content-addressed and
    outside a run's identity (hmscale.run_identity.PLACEMENT), so the module's runs share the `shared_inputs` ones."""
    inputs = tmp_path if inputs is None else inputs
    return [
        "teacher.flavor=pythia-nano", "teacher.pretrain_steps=4", "teacher.pretrain_batch_size=8",
        "tokenizer.vocab_size=512", "data.seq_len=64", "data.sequences_per_shard=16", "data.max_documents=40",
        f"data.cache_dir={inputs / 'data'}", f"cache.root={inputs / 'cache'}", "cache.max_tokens=2048",
        "cache.capture.dtype=float32", "cache.capture.topk=8", "cache.engine=local", "cache.capture.token_fraction=0.5",
        "stage1.steps=4", "stage1.micro_batch_size=4", "stage2.steps=4", "stage2.micro_batch_size=4",
        "stage2.kd_weight=0.5", "stage2.eval_every=2", "eval.max_sequences=4", "parallel.checkpoint_every=2",
        f"output_dir={tmp_path / 'run'}", "parallel.engine=local",
    ]


@pytest.fixture(scope="module")
def shared_inputs(tmp_path_factory):
    """The data directory and teacher-cache root of the module's runs: the tokenizer is trained, the documents
    tokenized and the miniature teacher pretrained once (per pytest worker), not once per test."""
    return tmp_path_factory.mktemp("distill_inputs")


@pytest.fixture(scope="module")
def finished_run(shared_inputs):
    """One finished engine=local run of `_overrides` (stage 1 from the cache, stage 2 with KD, the HF export) and
    run_distill's result: the layout test and the eval test each get a copy of its output_dir (`_copy_run`)."""
    from hmscale.config import build_config
    from ray_jobs.distill import run_distill

    out = shared_inputs / "finished"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HMSCALE_NO_PROGRESS", "1")
        res = run_distill(build_config({}, _overrides(out, shared_inputs)), log=lambda *a, **k: None)
    return out / "run", res


def _copy_run(finished_run, tmp_path):
    import shutil

    shutil.copytree(finished_run[0], tmp_path / "run")
    return finished_run[1]


# (the two tests of the finished run on one pytest worker: the run is trained once)
@pytest.mark.xdist_group("distill_local_finished_run")
def test_local_distill_layout_and_export(tmp_path, monkeypatch, shared_inputs, finished_run):
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    from hmscale.config import build_config
    from ray_jobs.distill import run_distill

    cfg = build_config({}, _overrides(tmp_path, shared_inputs))
    res = _copy_run(finished_run, tmp_path)  # run_distill(cfg)'s result, in this output_dir
    run = tmp_path / "run"
    assert res["stage1"]["done"] and res["stage1"]["mode"] == "cache" and res["stage2"]["done"]
    for rel in ["config.yaml", "stage1/student/feature_maps.safetensors", "stage1/student/student.json",
                "stage1/metrics.jsonl", "stage1/summary.json", "stage1/checkpoints/step_00000004/meta.json",
                "stage2/metrics.jsonl", "stage2/summary.json", "stage2/hf/config.json", "stage2/hf/modeling_hedgemamba.py",
                "stage2/checkpoints/step_00000004/meta.json"]:
        assert (run / rel).exists(), rel
    assert list((run / "stage1" / "tb").iterdir()) and list((run / "stage2" / "tb").iterdir())
    recs = [json.loads(l) for l in (run / "stage2" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "eval" and "val_loss" in r for r in recs)
    assert all("kd" in r and "ce" in r for r in recs if r["kind"] == "train")
    # the export loads with transformers and matches the trained model's validation loss
    from transformers import AutoModelForCausalLM

    import hmscale.models  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(str(run / "stage2" / "hf")).eval()
    x = torch.randint(0, 512, (1, 16))
    assert model(input_ids=x).logits.shape == (1, 16, model.config.vocab_size)
    # a rerun into the same directory: nothing left to train; each stage reports what it recorded when it ran
    summaries = {s: (run / s / "summary.json").read_text() for s in ("stage1", "stage2")}
    res2 = run_distill(cfg, log=lambda *a, **k: None)
    for s in ("stage1", "stage2"):
        assert res2[s]["skipped"] and res2[s]["tokens"] == res[s]["tokens"] > 0 and res2[s]["final_loss"] == res[s]["final_loss"]
        assert (run / s / "summary.json").read_text() == summaries[s]  # not rewritten by an empty resume
    # a rerun with other training settings (`python -m ray_jobs.distill` calls this too) is refused, and the run's
    # config.yaml still says what it trained (it was overwritten by the new settings while reporting "skipped")
    saved = (run / "config.yaml").read_text()
    from hmscale.config import ConfigError

    with pytest.raises(ConfigError, match=r"output_dir: .* holds a run of a different config \(stage2.steps: 4 -> 10\)"):
        run_distill(build_config({}, _overrides(tmp_path, shared_inputs) + ["stage2.steps=10"]),
                    log=lambda *a, **k: None)
    assert (run / "config.yaml").read_text() == saved


@pytest.mark.xdist_group("distill_local_finished_run")
def test_cli_eval_scores_long_contexts(tmp_path, capsys, monkeypatch, shared_inputs, finished_run):
    """`hmscale eval --context-length` on a finished run: the three models, per position bucket, from the run's files."""
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    from hmscale.cli import main

    _copy_run(finished_run, tmp_path)  # run_distill(_overrides(tmp_path, shared_inputs)), trained once for the module
    (tmp_path / "run" / "results.json").write_text("{}")  # what `hmscale run` leaves; eval only needs the run's files
    capsys.readouterr()  # the training's output
    args = ["eval", *[a for o in _overrides(tmp_path, shared_inputs) for a in ("-s", o)], "--context-length", "256"]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out)
    lc = res["long_context"]
    assert lc["length"] == 256 and lc["train_seq_len"] == 64 and lc["buckets"] == [[1, 64], [64, 128], [128, 256]]
    assert lc["rows_from"] in ("documents", "stream") and 1 <= lc["rows"] <= 4
    for name in ("teacher", "hedgehog", "hedgemamba"):
        assert len(lc["ppl"][name]) == 3 and all(p > 1 for p in lc["ppl"][name]) and name + "_ppl" in res
    assert main(args[:-1] + ["100000000"]) == 2  # longer than the whole validation split: one line
    assert "eval.context_length" in capsys.readouterr().err


def test_cli_stage2_without_stage1_is_a_one_line_error(tmp_path, capsys, monkeypatch, shared_inputs):
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    from hmscale.cli import main

    ov = [a for o in _overrides(tmp_path, shared_inputs) if not o.startswith("stage2.kd_weight") for a in ("-s", o)]
    rc = main(["stage2", *ov, "-s", "stage2.kd_weight=0"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1 and err.startswith("hmscale: error: no stage-1 student"), err


def test_local_engine_two_worker_processes_kill_and_resume(tmp_path, monkeypatch, shared_inputs):
    """engine=local, num_workers=2: two spawned gloo processes (torchrun-style, no Ray) run stage 1 and
    stage 2 with ZeRO-2; a worker SIGKILLed in stage 2 stops the run with a one-line error, and a rerun
    into the same directory resumes from the last checkpoint and finishes."""
    from hmscale.config import build_config
    from hmscale.train.engine import TrainingError
    from ray_jobs.distill import FAULT_ENV, run_distill

    from pathlib import Path

    import hmscale.train.launch as launch

    # the process groups' ports: DeepSpeed names its CPU all-reduce buffers after them, and only this run's count
    # (tests running beside this one, under pytest-xdist, have buffers of their own)
    ports = []
    monkeypatch.setattr(launch, "free_port", lambda real=launch.free_port: ports.append(real()) or ports[-1])

    def shm():
        return {p for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")
                if any(f"_{port}_" in p.name for port in ports)}

    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    cfg = build_config({}, _overrides(tmp_path, shared_inputs) + ["parallel.num_workers=2", "parallel.zero_stage=2"])
    monkeypatch.setenv(FAULT_ENV, "stage2:3:1")  # rank 1 dies at the start of stage-2 step 3 (after the step-2 checkpoint)
    with pytest.raises(TrainingError, match=r"local worker \d died .*rerun into the same output_dir"):
        run_distill(cfg, log=lambda *a, **k: None)
    run = tmp_path / "run"
    assert json.loads((run / "stage1" / "summary.json").read_text())["done"]
    assert not (run / "stage2" / "summary.json").exists()
    res = run_distill(cfg, log=lambda *a, **k: None)  # the fault marker exists: no second kill
    s2 = res["stage2"]
    assert s2["done"] and s2["dp"] == 2 and s2["start_step"] == 2 and s2["end_step"] == 4
    assert s2["tokens"] == 4 * 4 * 2 * 64  # the whole stage's, the killed attempt's two steps included
    assert (run / "stage2" / "hf" / "config.json").exists()
    assert len(ports) == 2 and shm() == set()  # DeepSpeed's CPU all-reduce buffers do not outlive the run, even the killed one's


def test_separate_stage_commands_then_rerun_and_run_report_the_recorded_stages(tmp_path, capsys, monkeypatch,
                                                                               shared_inputs):
    """`hmscale stage1`, `hmscale stage2`, then `hmscale stage2` again (the finished stage is skipped with one clear
    line, exit 0, its summary kept) and `hmscale run`: results.json and report.md carry the tokens and seconds each
    stage recorded when it ran, not the zeros of a stage that trained nothing."""
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    from hmscale.cli import main

    args = [a for o in _overrides(tmp_path, shared_inputs) + ["stage2.kd_weight=0"] for a in ("-s", o)]
    run = tmp_path / "run"
    assert main(["stage1", *args]) == 0 and main(["stage2", *args]) == 0
    recorded = {s: json.loads((run / s / "summary.json").read_text()) for s in ("stage1", "stage2")}
    assert recorded["stage1"]["tokens"] == 4 * 4 * 64 and recorded["stage2"]["tokens"] == 4 * 4 * 64
    capsys.readouterr()
    assert main(["stage2", *args]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("[distill] nothing to train: stage-2 already done (skipped; loss ") and "stage2/hf" in line, line
    assert json.loads((run / "stage2" / "summary.json").read_text()) == recorded["stage2"]
    assert main(["run", *args]) == 0
    results = json.loads((run / "results.json").read_text())
    assert results["tokens"] == {s: recorded[s]["tokens"] for s in ("stage1", "stage2")}
    assert results["inputs_dir"] == os.getcwd()  # (where `hmscale eval RUN_DIR` reads the run's relative inputs)
    for s in ("stage1", "stage2"):
        assert results["stages"][s]["seconds"] == round(recorded[s]["seconds"], 2) > 0
    report = (run / "report.md").read_text()
    # (the report shows results.json's seconds, already rounded to 0.01: format those, not the summary's, which can
    # round the other way at 1 decimal, e.g. 0.6451 -> 0.6 but 0.65 -> 0.7)
    # (stage 2 was trained by `hmscale stage2`, before this run: marked as such)
    assert (f"| stage2 (finished earlier, skipped) | {results['stages']['stage2']['seconds']:.1f} | "
            f"{recorded['stage2']['tokens']} |") in report


def test_local_engine_layer_parallel_stage1_then_stage2_in_one_call(tmp_path, monkeypatch, shared_inputs):
    """engine=local, 2 worker processes: a layer-parallel stage 1 (DeepSpeed given its layer-parallel mpu) and then,
    in the same processes, a data-parallel stage 2 (no mpu). DeepSpeed keeps the last mpu it was given in a
    process-wide global: stage 2 must not inherit stage 1's (it crashed on it, and would have partitioned ZeRO over
    stage 1's one-rank groups). Stage 2 trains as it does in fresh processes, to the same losses."""
    import shutil

    from hmscale.config import build_config
    from hmscale.train.engine import read_metrics
    from ray_jobs.distill import run_distill

    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    ov = [o for o in _overrides(tmp_path, shared_inputs)
          if not o.startswith(("stage1.steps", "stage2.steps", "stage2.kd_weight"))]
    cfg = build_config({}, ov + ["stage1.steps=2", "stage2.steps=3", "stage2.kd_weight=0", "parallel.num_workers=2",
                                 "stage1.layer_parallel=true", "parallel.zero_stage=1"])
    res = run_distill(cfg, log=lambda *a, **k: None)
    run = tmp_path / "run"
    assert res["stage1"]["done"] and res["stage1"]["layer_parallel"]
    assert res["stage2"]["done"] and res["stage2"]["dp"] == 2 and res["stage2"]["tokens"] == 3 * 4 * 2 * 64
    # stage 2 alone, in fresh worker processes, from the same stage-1 student
    again = tmp_path / "again"
    shutil.copytree(run / "stage1", again / "stage1")
    alone = run_distill(cfg, again, stages=("stage2",), log=lambda *a, **k: None)
    assert alone["stage2"]["done"] and alone["stage2"]["final_loss"] == res["stage2"]["final_loss"]
    assert [r["loss"] for r in read_metrics(run / "stage2" / "metrics.jsonl")] == \
        [r["loss"] for r in read_metrics(again / "stage2" / "metrics.jsonl")]


def test_run_refuses_a_context_length_longer_than_the_data_before_training(tmp_path, capsys, monkeypatch,
                                                                           shared_inputs):
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    from hmscale.cli import main

    args = ["run", *[a for o in _overrides(tmp_path, shared_inputs) for a in ("-s", o)],
            "-s", "eval.context_length=100000000"]
    assert main(args) == 2
    assert "eval.context_length: the validation split has" in capsys.readouterr().err
    assert not (tmp_path / "run" / "stage1").exists()
