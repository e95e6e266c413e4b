"""The data pipeline, the config, the command line and the sweeps: user input taken, noted or refused in one line."""

import pytest

from hmscale.config import ConfigError, build_config, load_config

JSONL = '{"text": "alpha beta gamma"}\n{"text": "delta epsilon"}\n'


# --------------------------------------------------------------------------- numbers written with an exponent


@pytest.mark.parametrize("raw, want", [("1e6", 1_000_000), ("2.5e5", 250_000), ("4E3", 4000), ("1.0e+6", 1_000_000)])
def test_an_integer_setting_takes_a_number_written_with_an_exponent(raw, want, tmp_path):
    # YAML 1.1 reads 1e6 (no dot) and 2.5e5 (unsigned exponent) as text: an integer field refused them with
    # "unable to parse string as an integer (got '1e6')", though a float field (stage2.lr=1e-3) took the same form
    assert build_config(overrides=[f"budget.total_tokens={raw}"]).budget.total_tokens == want
    assert build_config(overrides=[f"data.max_tokens={raw}"]).data.max_tokens == want
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"budget:\n  total_tokens: {raw}\n")
    assert load_config(str(cfg)).budget.total_tokens == want


def test_an_exponent_keeps_the_checks_of_the_field_and_text_fields_stay_text():
    with pytest.raises(ConfigError, match="budget.total_tokens: .*fractional part"):
        build_config(overrides=["budget.total_tokens=1e-3"])
    with pytest.raises(ConfigError, match="budget.total_tokens: .*greater than 0"):
        build_config(overrides=["budget.total_tokens=-1e3"])
    assert build_config(overrides=["budget.split=[1e-1, 9e-1]"]).budget.split == (0.1, 0.9)
    # a text field is not a number: an all-digit-and-e dataset revision stays the text it is
    cfg = build_config(overrides=["data.source=hf", "data.dataset=x", "data.revision=12e4567"])
    assert cfg.data.revision == "12e4567"


# --------------------------------------------------------------------------- data.paths: check says what prepare does


def test_a_file_whose_name_holds_glob_characters_is_read(tmp_path, monkeypatch):
    # `data[1].jsonl` was globbed as a pattern (data1.jsonl): "does not exist" for a file that exists
    from hmscale.data.sources import FileSource

    monkeypatch.chdir(tmp_path)
    (tmp_path / "shard[1].jsonl").write_text(JSONL)
    cfg = build_config(overrides=["data.source=files", "data.paths=['shard[1].jsonl']"])
    src = FileSource(cfg.data.paths, val_fraction=0.01)
    assert sorted(src.documents("train") + src.documents("validation")) == ["alpha beta gamma", "delta epsilon"]
    # a pattern is still a pattern where no such file exists
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "a1.jsonl").write_text(JSONL)
    assert FileSource(["more/a[0-9].jsonl"]).files == ["more/a1.jsonl"]


@pytest.mark.parametrize("entry, says", [("notes.md", "'notes.md' has an unsupported extension; use .txt, .text, "
                                                       ".jsonl, .json or .parquet"),
                                         ("empty", "'empty' holds no .txt, .text, .jsonl, .json or .parquet file"),
                                         ("*.md", "has an unsupported extension")])
def test_check_refuses_the_data_paths_that_prepare_refuses(tmp_path, monkeypatch, capsys, entry, says):
    # `hmscale check` passed a folder without a readable file and a file of another kind, which `hmscale prepare`
    # (and `run`, after its checks) then refused
    from hmscale.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.md").write_text("hello")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden.jsonl").write_text(JSONL)
    assert main(["check", "-s", "data.source=files", "-s", f"data.paths=['{entry}']"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hmscale: error: data.paths: ") and says in err and "\n" not in err


def test_check_takes_a_folder_with_a_readable_file_deep_down(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus" / "a" / "b").mkdir(parents=True)
    (tmp_path / "corpus" / "a" / "b" / "x.TXT").write_text("hello")
    assert build_config(overrides=["data.source=files", "data.paths=[corpus]"]).data.paths == ["corpus"]


# --------------------------------------------------------------------------- hmscale submit


def _submit(args, monkeypatch):
    import ray.job_submission

    from hmscale.cli import main

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", lambda *a, **k: pytest.fail("contacted the cluster"))
    shared = ["output_dir=/mnt/shared/runs/x", "data.cache_dir=/mnt/shared/data", "cache.root=/mnt/shared/teacher"]
    return main(["submit", "--address", "http://10.1.2.3:8265", *args, *[a for s in shared for a in ("-s", s)]])


def test_a_timeout_with_no_follow_is_refused(monkeypatch, capsys):
    # the timeout is kept by the loop that follows the job: with --no-follow the job ran on, unstopped, without a word
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    assert _submit(["--no-follow", "--timeout", "60"], monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hmscale: error: --timeout 60 with --no-follow") and "\n" not in err


@pytest.mark.parametrize("kind", ["folder", "empty", "binary"])
def test_a_token_file_that_holds_no_token_is_one_line(tmp_path, monkeypatch, capsys, kind):
    # a folder: IsADirectoryError's traceback; an empty file: sent as no token, then "none was found (--token-file ...)"
    token = tmp_path / "tok"
    if kind == "folder":
        token.mkdir()
    else:
        token.write_bytes(b"\n" if kind == "empty" else b"\xff\xfe\x00")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    assert _submit(["--token-file", str(token), "--no-follow"], monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hmscale: error: --token-file {str(token)!r} ") and "\n" not in err
    assert ("is empty" if kind == "empty" else "cannot be read") in err


# --------------------------------------------------------------------------- hmscale scale run: options without effect


@pytest.mark.parametrize("args, says", [
    (["--sizes", "nano", "--budget-fraction", "0.1"], "--budget-fraction has no effect on the miniature sizes"),
    (["--sizes", "70m", "--split", "20/80", "-s", "budget.split=[0.3,0.7]"], "--split has no effect: budget.split is set"),
    (["--sizes", "70m", "--budget-fraction", "0.1", "-s", "budget.total_tokens = 5"],
     "--budget-fraction has no effect: budget.total_tokens is set"),
])
def test_a_budget_option_the_sweep_does_not_use_is_noted(tmp_path, monkeypatch, capsys, args, says):
    import scaling.sweep
    from ray_jobs import scaling as cli

    monkeypatch.setattr(scaling.sweep, "run_sweep", lambda *a, **k: [])
    assert cli.main([*args, "--out", str(tmp_path)]) == 0
    assert f"hmscale: note: {says}" in capsys.readouterr().err


def test_budget_options_that_apply_are_not_noted(tmp_path, monkeypatch, capsys):
    import scaling.sweep
    from ray_jobs import scaling as cli

    monkeypatch.setattr(scaling.sweep, "run_sweep", lambda *a, **k: [])
    assert cli.main(["--sizes", "nano,70m", "--budget-fraction", "0.1", "--split", "20/80", "--out", str(tmp_path)]) == 0
    assert "note" not in capsys.readouterr().err


# --------------------------------------------------------------------------- a YAML key written twice


def test_a_section_written_twice_in_a_config_file_is_refused(tmp_path, capsys):
    # YAML keeps the last of two equal keys: the first `stage2:` section, its lr with it, was dropped without a word
    from hmscale.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage2:\n  lr: 1.0e-4\nbudget:\n  total_tokens: 1000\nstage2:\n  steps: 10\n")
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hmscale: error: config file {str(cfg)!r} is not valid YAML: 'stage2' is set twice in one mapping "
                   "(lines 1 and 5): the second would replace the first whole; keep one")
    cfg.write_text("stage2: {lr: 1.0e-4, lr: 2.0e-4}\n")
    with pytest.raises(ConfigError, match="'lr' is set twice in one mapping \\(line 1\\)"):
        load_config(str(cfg))
    with pytest.raises(ConfigError, match="^override 'stage2={lr: 1, lr: 2}': 'lr' is set twice"):
        build_config(overrides=["stage2={lr: 1, lr: 2}"])


def test_a_merge_key_may_still_be_overridden(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage1: &s\n  lr: 0.02\n  warmup_steps: 3\nstage2:\n  <<: *s\n  lr: 0.005\n")
    c = load_config(str(cfg))
    assert (c.stage1.lr, c.stage2.lr, c.stage2.warmup_steps) == (0.02, 0.005, 3)


# --------------------------------------------------------------------------- hmscale scale plan


@pytest.mark.parametrize("raw, total", [("1e9", "1B"), ("1.5e9", "1.5B"), ("2_000_000_000", "2B")])
def test_scale_plan_takes_a_token_budget_written_with_an_exponent(raw, total):
    # typer's int refused `--tokens 1e9` ("unable to parse string as an integer"), the way budgets are written
    from typer.testing import CliRunner

    from hmscale.cli import app

    res = CliRunner().invoke(app, ["scale", "plan", "--sizes", "70m", "--tokens", raw])
    assert res.exit_code == 0, res.output
    row = next(ln for ln in res.output.splitlines() if "pythia-70m" in ln)
    assert f" {total} " in row


@pytest.mark.parametrize("args, says", [(["--tokens", "1e-3"], "--tokens: '1e-3' is not a whole number of tokens"),
                                        (["--tokens", "lots"], "--tokens: 'lots' is not a whole number of tokens"),
                                        (["--gpu-mem", "nan"], "plan: gpu_mem_gb must be positive"),
                                        (["--gpu-mem", "inf"], "plan: gpu_mem_gb must be positive")])
def test_scale_plan_refuses_what_is_no_budget_or_memory_in_one_line(args, says):
    # --gpu-mem nan planned every size as "does not fit 4096 GPUs of nan GB"; inf fitted anything on one GPU
    from typer.testing import CliRunner

    from hmscale.cli import app

    res = CliRunner().invoke(app, ["scale", "plan", "--sizes", "70m", *args])
    assert res.exit_code == 2 and res.output.strip().startswith(f"hmscale: error: {says}")


# --------------------------------------------------------------------------- a data setting its data.source never reads


@pytest.mark.parametrize("given, field, source", [
    (["data.paths=[corpus.jsonl]"], "data.paths", "files"),  # the run trained on the stdlib corpus instead
    (["data.dataset=org/corpus"], "data.dataset", "hf"),
    (["data.source=files", "data.paths=[corpus.jsonl]", "data.split=validation"], "data.split", "hf"),
    (["data.source=files", "data.paths=[corpus.jsonl]", "data.include_site_packages=true"],
     "data.include_site_packages", "embedded"),
    (["data.text_field=body"], "data.text_field", "files"),
])
def test_a_data_setting_that_the_source_does_not_read_is_noted(tmp_path, monkeypatch, capsys, given, field, source):
    # each was dropped without a word: data.paths without data.source=files trained on the embedded stdlib corpus
    from hmscale.cli import main
    from hmscale.config import unused_settings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.jsonl").write_text(JSONL)
    notes = [n for n in unused_settings(build_config(overrides=given)) if n.startswith(f"{field}=")]
    assert len(notes) == 1 and f"has no effect: data.source={build_config(overrides=given).data.source} " in notes[0]
    assert notes[0].endswith(f"set data.source={source}, or remove the {field} setting")
    assert main(["check", *[a for g in given for a in ("-s", g)]]) == 0
    assert f"hmscale: note: {notes[0]}" in capsys.readouterr().err


def test_the_data_settings_of_each_source_are_not_noted(tmp_path, monkeypatch):
    from hmscale.config import unused_settings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.jsonl").write_text(JSONL)
    for given in (["data.source=files", "data.paths=[corpus.jsonl]", "data.text_field=body"],
                  ["data.source=hf", "data.dataset=org/c", "data.dataset_config=en", "data.split=validation"],
                  ["data.include_site_packages=true"]):
        assert unused_settings(build_config(overrides=given)) == []


@pytest.mark.parametrize("name", ["pythia-410m.yaml", "pythia-1b-paper.yaml"])
def test_the_shipped_configs_pass(name):
    from pathlib import Path

    load_config(str(Path(__file__).resolve().parents[1] / "configs" / name))


# --------------------------------------------------------------------------- hmscale scale run: placement options


@pytest.mark.parametrize("args, says", [
    (["--local", "--num-cpus", "4"], "--num-cpus 4: places the sizes' Ray tasks, but --local runs every size in this "
                                     "process, one after another; remove --num-cpus or --local"),
    (["--local", "--address", "10.0.0.1:6379"], "--address 10.0.0.1:6379: places the sizes' Ray tasks"),
    (["--local", "--resources", '{"*": {"num_gpus": 1}}'], "--resources {\"*\": {\"num_gpus\": 1}}: places"),
    (["--local", "--cpus-per-size", "4"], "--cpus-per-size 4.0: places the sizes' Ray tasks"),
    (["--num-cpus", "4", "--address", "10.0.0.1:6379"], "--num-cpus 4: sizes the embedded cluster, but --address "
                                                         "10.0.0.1:6379 joins a running one"),
])
def test_a_placement_option_the_sweep_would_drop_is_refused(tmp_path, monkeypatch, capsys, args, says):
    # each was dropped without a word: --local starts no Ray task, a joined cluster keeps its own CPUs
    import scaling.sweep
    from ray_jobs import scaling as cli

    monkeypatch.setattr(scaling.sweep, "run_sweep", lambda *a, **k: pytest.fail("ran the sweep"))
    assert cli.main(["--sizes", "nano", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hmscale: error: {says}") and err.count("\n") == 1


def test_scale_run_local_with_its_default_cpus_per_size_is_taken(tmp_path, monkeypatch):
    # `hmscale scale run` passes its --cpus-per-size default (1.0) on: not an option the user gave
    from typer.testing import CliRunner

    import scaling.sweep
    from hmscale.cli import app

    monkeypatch.setattr(scaling.sweep, "run_sweep", lambda *a, **k: [])
    res = CliRunner().invoke(app, ["scale", "run", "--sizes", "nano", "--out", str(tmp_path), "--local"])
    assert res.exit_code == 0, res.output


# --------------------------------------------------------------------------- one value where a list goes


@pytest.mark.parametrize("given, says", [
    ("eval.tasks=hellaswag", "eval.tasks: Input should be a valid list (got 'hellaswag'); write a list in brackets: "
                             "-s 'eval.tasks=[hellaswag]' on the command line, [hellaswag] in YAML"),
    ("cache.capture.layers=3", "cache.capture.layers: Input should be a valid list, or Input should be 'all' (got 3); "
                               "write a list in brackets: -s 'cache.capture.layers=[3]'"),
    ("budget.split=10/90", "budget.split: Input should be a valid tuple (got '10/90'); write a list in brackets: "
                           "-s 'budget.split=[a, b]'"),
])
def test_one_value_where_a_list_goes_says_how_to_write_the_list(given, says):
    # "Input should be a valid list (got 'hellaswag')" said what was wrong, not what to write instead
    with pytest.raises(ConfigError) as err:
        build_config(overrides=[given])
    assert str(err.value).startswith(says)
    assert build_config(overrides=["eval.tasks=[hellaswag]"]).eval.tasks == ["hellaswag"]


# --------------------------------------------------------------------------- parquet files are read in place


def test_a_parquet_corpus_is_read_in_place_without_a_copy_in_the_datasets_cache(tmp_path, monkeypatch):
    # `datasets.load_dataset("parquet")` wrote an Arrow copy of each file, every column, uncompressed, into
    # ~/.cache/huggingface/datasets (13x the file here): a large corpus filled the home directory, outside data.cache_dir
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hmscale.data.sources import FileSource

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    texts = [f"document {i} " * 20 for i in range(3000)]
    pq.write_table(pa.table({"text": texts, "n": list(range(3000))}), tmp_path / "a.parquet", row_group_size=700)
    pq.write_table(pa.table({"text": pa.array(["x y", None, "", "z w"]).dictionary_encode()}), tmp_path / "b.parquet")
    src = FileSource([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], val_fraction=0.1)
    train, val = src.documents("train"), src.documents("validation")
    assert sorted(train + val) == sorted(texts + ["x y", "z w"])  # every row once, in file order within a split
    assert train == [t for t in texts + ["x y", "z w"] if t in set(train)]
    assert src.skipped["train"] == 2
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("table, says", [
    ({"body": ["a"]}, r"^data.text_field: 'text' is not a column of '.*c.parquet'; choose one of body$"),
    ({"text": [1, 2]}, r"^data.text_field: 'text' of '.*c.parquet' holds int64 values, not text; choose a text column$"),
])
def test_a_parquet_file_without_the_text_field_is_one_line(tmp_path, table, says):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hmscale.data.sources import FileSource

    pq.write_table(pa.table(table), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=says):
        FileSource([str(tmp_path / "c.parquet")]).documents("train")


# --------------------------------------------------------------------------- a run's identity and its inputs' paths


def _files_cfg(paths, run_dir):
    return build_config({}, ["data.source=files", f"data.paths={paths}", f"output_dir={run_dir}"]).with_absolute_paths()


def test_a_run_submitted_to_a_local_cluster_is_resumed_by_hmscale_run_and_back(tmp_path, monkeypatch):
    # `hmscale submit` to a cluster on this machine writes data.paths absolute into the job's config; `hmscale run`
    # keeps them as given: each refused the other's run ("holds a run of a different config (data.paths: ...)")
    import json

    from hmscale.config import save_resolved
    from hmscale.run_identity import run_mismatch, saved_config_mismatch, training_hash
    from hmscale.submit import place_directories

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my corpus").mkdir()
    (tmp_path / "my corpus" / "a.jsonl").write_text(JSONL)
    run_dir = tmp_path / "runs" / "x"
    as_run = _files_cfg("['my corpus']", run_dir)
    as_job = place_directories(as_run, "http://127.0.0.1:8265", tmp_path).with_absolute_paths()
    assert as_job.data.paths == [str(tmp_path / "my corpus")]
    for first, then, inputs_dir in ((as_job, as_run, "/tmp/ray/session_1/working_dir_files/_ray_pkg_1"),
                                    (as_run, as_job, str(tmp_path))):
        save_resolved(first, run_dir)
        (run_dir / "results.json").write_text(json.dumps({"config_hash": training_hash(first), "stages": {},
                                                          "inputs_dir": inputs_dir}))
        assert run_mismatch(run_dir, training_hash(first), then) is None
        (run_dir / "results.json").unlink()
        assert saved_config_mismatch(run_dir, then) is None  # (the stage commands' test, without results.json)


def test_inputs_naming_other_files_are_still_another_run(tmp_path, monkeypatch):
    import json

    from hmscale.config import save_resolved
    from hmscale.run_identity import run_mismatch, training_hash

    monkeypatch.chdir(tmp_path)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "c.jsonl").write_text(JSONL)
    run_dir = tmp_path / "run"
    first = _files_cfg("[a]", run_dir)
    save_resolved(first, run_dir)
    (run_dir / "results.json").write_text(json.dumps({"config_hash": training_hash(first), "stages": {},
                                                      "inputs_dir": str(tmp_path)}))
    assert run_mismatch(run_dir, training_hash(first), _files_cfg(f"[{tmp_path / 'b'}]", run_dir)) == [
        f"data.paths: ['a'] -> ['{tmp_path / 'b'}']"]
    # the run read `a` in another folder: the `a` here is other data
    (run_dir / "results.json").write_text(json.dumps({"config_hash": training_hash(first), "stages": {},
                                                      "inputs_dir": str(tmp_path / "b")}))
    assert run_mismatch(run_dir, training_hash(first), _files_cfg(f"[{tmp_path / 'a'}]", run_dir)) == [
        f"data.paths: ['a'] -> ['{tmp_path / 'a'}']"]


@pytest.mark.parametrize("option", ["--csv", "--json", "--plot", "--throughput"])
def test_scale_plan_with_a_folder_for_a_file_is_one_line(tmp_path, option):
    # IsADirectoryError's traceback, after the table for the outputs, before any plan for --throughput
    from typer.testing import CliRunner

    from hmscale.cli import app

    res = CliRunner().invoke(app, ["scale", "plan", "--sizes", "70m", option, str(tmp_path)])
    last = res.output.strip().splitlines()[-1]
    assert res.exit_code == (2 if option == "--throughput" else 1)
    says = "throughput table" if option == "--throughput" else "cannot write"
    assert last.startswith(f"hmscale: error: {says} {str(tmp_path)!r}") and "(Is a directory)" in last


# --------------------------------------------------------------------------- hmscale prepare's advice


def test_prepare_advises_raising_only_the_caps_that_are_set(tmp_path, capsys):
    # "add data or raise data.max_tokens / data.max_documents" with neither set: both already read all there is
    import json

    from hmscale.cli import main

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 8}) + "\n"
                            for i in range(60)))
    base = ["prepare", "-s", "data.source=files", "-s", f"data.paths=[{docs}]", "-s", "data.seq_len=32",
            "-s", "data.sequences_per_shard=4", "-s", "tokenizer.vocab_size=300", "-s", "data.val_fraction=0.2",
            "-s", f"data.cache_dir={tmp_path / 'cache'}", "-s", "budget.total_tokens=1e9"]
    assert main(base) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "the stages will revisit rows" in line and line.endswith("; add data")
    assert main([*base, "-s", "data.max_documents=40"]) == 0
    assert capsys.readouterr().out.strip().endswith("; add data or raise data.max_documents")


@pytest.mark.parametrize("text, says", [
    ("stage2:\n\tlr: 1\n", "found character '\\t' that cannot start any token (line 2, column 1)"),
    ("stage2:\n  lr: 1\n   steps: 3\n", "mapping values are not allowed here (line 3, column 9)"),
])
def test_a_config_file_that_is_not_yaml_says_what_and_where(tmp_path, text, says):
    # the first line of the parser's error is often its context alone: "while scanning for the next token"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(cfg))
    assert str(err.value) == f"config file {str(cfg)!r} is not valid YAML: {says}"


def test_a_sweep_out_that_is_a_file_is_one_line_before_any_work(tmp_path, capsys):
    # os.mkdir's FileExistsError traceback, after the sizes' configs were built and checked
    from ray_jobs import scaling as cli

    out = tmp_path / "notes.md"
    out.write_text("mine")
    assert cli.main(["--sizes", "nano", "--out", str(out), "--local", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hmscale: error: --out: {str(out)!r} is a file; give the sweep a directory")
    assert err.count("\n") == 1 and out.read_text() == "mine"


def test_a_sweep_table_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    import errno

    import scaling.sweep
    from ray_jobs import scaling as cli

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "results.csv"))

    monkeypatch.setattr(scaling.sweep, "run_sweep", full)
    assert cli.main(["--sizes", "nano", "--out", str(tmp_path), "--local"]) == 1
    assert capsys.readouterr().err == (f"hmscale: error: {tmp_path / 'results.csv'}: No space left on device; give "
                                       "--out a directory you can write (with room)\n")


def test_a_json_array_is_read_in_place_without_a_copy_in_the_datasets_cache(tmp_path, monkeypatch):
    # as parquet: `datasets.load_dataset("json")` wrote an Arrow copy of a JSON array into ~/.cache/huggingface
    import json

    import datasets.config

    from hmscale.data.sources import FileSource

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    rows = [{"text": f"row {i} ünï 日本", "n": i} for i in range(50)] + [{"n": 1}, {"text": None}, {"text": ""}]
    (tmp_path / "a.json").write_bytes(b"\xef\xbb\xbf\n " + json.dumps(rows).encode())
    src = FileSource([str(tmp_path / "a.json")], val_fraction=0.2)
    train, val = src.documents("train"), src.documents("validation")
    assert sorted(train + val) == sorted(r["text"] for r in rows[:50]) and src.skipped["train"] == 3
    assert train == [r["text"] for r in rows[:50] if r["text"] in set(train)]
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("text, says", [
    ('[{"body": "x"}]', r"^data.text_field: 'text' is not a column of '.*c.json'; choose one of body$"),
    ('[{"text": 5}]', r"^data.text_field: 'text' of '.*c.json' holds int values \('5'\), not text"),
    ('[1, 2]', r"^data.paths: '.*c.json' is not readable as json: a list of objects"),
    ('[{"text": "a b"', r"^data.paths: '.*c.json' is not readable as json: Expecting"),
    ('[{"text": "a \\ud800 b"}]', r"^data.paths: '.*c.json' holds text in 'text' that is not valid Unicode"),
])
def test_a_json_array_that_holds_no_text_rows_is_one_line(tmp_path, text, says):
    from hmscale.data.sources import FileSource

    (tmp_path / "c.json").write_text(text)
    with pytest.raises(ValueError, match=says):
        FileSource([str(tmp_path / "c.json")]).documents("train")


# --------------------------------------------------------------------------- hmscale eval RUN_DIR from another folder


def test_a_relative_data_path_found_nowhere_is_still_refused():
    # (eval from another folder looks for relative data.paths where the run read them too:
    # tests/eval/test_eval_from_another_folder.py, whose run is on data.source=files)
    with pytest.raises(ConfigError, match="data.paths: 'nodata/x.jsonl' does not exist"):
        build_config({}, ["data.source=files", "data.paths=[nodata/x.jsonl]"])
