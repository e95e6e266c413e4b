"""`hmscale eval RUN_DIR` from another folder than the run's: relative inputs (data.paths, a teacher folder) were
read from the caller's folder, so the eval failed on files it could not find (or scored other files of the same name).
They are read where the run read them (results.json's inputs_dir)."""

import json

import pytest

from hmscale.cli import main
from hmscale.config import build_config, save_resolved


@pytest.fixture
def run_made_in(tmp_path, monkeypatch):
    """A finished run trained in ``proj`` with data.paths relative to it; returns (proj, run_dir, seen data.paths)."""
    proj, run_dir = tmp_path / "proj", tmp_path / "proj" / "runs" / "r"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "train.jsonl").write_text('{"text": "def f(x): return x"}\n')
    monkeypatch.chdir(proj)
    cfg = build_config({"data": {"source": "files", "paths": ["data/*.jsonl"]}},
                       [f"output_dir={run_dir}"]).with_absolute_paths()
    save_resolved(cfg, run_dir)  # (as a run saves it: directories absolute, inputs as given)
    (run_dir / "results.json").write_text(json.dumps({"stages": {}, "inputs_dir": str(proj)}))
    seen = []

    def fake_prepare_data(cfg, log=print):
        seen.append(list(cfg.data.paths))
        raise ValueError("stop here")

    import hmscale.data

    monkeypatch.setattr(hmscale.data, "prepare_data", fake_prepare_data)
    return proj, run_dir, seen


def test_eval_of_a_run_from_another_folder_reads_the_runs_own_inputs(tmp_path, monkeypatch, run_made_in, capsys):
    # (data.source=files: the config's own check of data.paths also looked from the caller's folder, and stopped on
    # "data.paths: 'data/*.jsonl' does not exist" before they were read where the run did; fifteenth session)
    proj, run_dir, seen = run_made_in
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["eval", str(run_dir)]) == 2 and "stop here" in capsys.readouterr().err
    assert seen == [[str(proj / "data" / "*.jsonl")]]


def test_eval_from_the_runs_folder_keeps_the_inputs_as_given(run_made_in, capsys):
    _, run_dir, seen = run_made_in
    assert main(["eval", "runs/r"]) == 2
    assert seen == [["data/*.jsonl"]]


def test_eval_from_another_folder_finds_a_teacher_folder_given_as_dot_path(tmp_path, monkeypatch, capsys):
    """teacher.name_or_path=./teacher (a path the config checks at load, unlike a bare relative name): the check
    looked in the caller's folder and refused the run's own config ("has no config.json") before the inputs were
    moved to the run's folder; it now also looks where the run was made (fourteenth session)."""
    from hmscale.teacher.flavors import neox_config

    proj, run_dir = tmp_path / "proj", tmp_path / "proj" / "runs" / "r"
    (proj / "teacher").mkdir(parents=True)
    neox_config("pythia-nano", vocab_size=300).to_json_file(str(proj / "teacher" / "config.json"))
    monkeypatch.chdir(proj)
    cfg = build_config({}, [f"output_dir={run_dir}", "teacher.name_or_path=./teacher",
                            "tokenizer.vocab_size=300"]).with_absolute_paths()
    save_resolved(cfg, run_dir)
    (run_dir / "results.json").write_text(json.dumps({"stages": {}, "inputs_dir": str(proj)}))
    seen = []

    def fake_prepare_data(cfg, log=print):
        seen.append(cfg.teacher.name_or_path)
        raise ValueError("stop here")

    import hmscale.data

    monkeypatch.setattr(hmscale.data, "prepare_data", fake_prepare_data)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["eval", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "stop here" in err, err
    assert seen == [str(proj / "teacher")]
    # outside an eval of that run the check still looks in the working directory only
    with pytest.raises(Exception, match="has no config.json"):
        build_config({}, ["teacher.name_or_path=./teacher", "tokenizer.vocab_size=300"])
