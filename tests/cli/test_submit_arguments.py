"""`hmscale submit` arguments that sent a job doomed from the start: refused before anything is sent."""

import pytest

from hmscale.config import build_config
from hmscale.submit import SubmitError, place_directories

SHARED = ["output_dir=/mnt/shared/runs/x", "data.cache_dir=/mnt/shared/data", "cache.root=/mnt/shared/teacher"]


@pytest.mark.parametrize("timeout", ["0", "-5"])
def test_a_timeout_that_is_not_positive_is_refused_before_anything_is_sent(monkeypatch, capsys, timeout):
    # `--timeout 0` (or a negative one) uploaded the checkout, started the job and stopped it at the first poll
    import ray.job_submission

    from hmscale.cli import main

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", lambda *a, **k: pytest.fail("contacted the cluster"))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    args = ["submit", "--address", "http://10.1.2.3:8265", "--timeout", timeout] + [a for s in SHARED for a in ("-s", s)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hmscale: error: --timeout: ") and "\n" not in err


@pytest.mark.parametrize("path", ["../corpus/*.txt", "data/../../corpus", ".cache/corpus.txt", "runs/old/a.txt"])
def test_a_relative_data_path_that_does_not_travel_with_the_checkout_is_refused_for_a_remote_cluster(tmp_path,
                                                                                                     monkeypatch, path):
    # relative data.paths inside the checkout travel with its upload; one outside it, or under a folder the upload
    # leaves out (.cache, runs, .venv, ...), passed the check here and failed on the cluster after the upload
    # ("data.paths: ... does not exist": it does, here)
    checkout = tmp_path / "checkout"
    for p in (tmp_path / "corpus" / "a.txt", checkout / "data" / "a.txt", checkout / ".cache" / "corpus.txt",
              checkout / "runs" / "old" / "a.txt"):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("text")
    monkeypatch.chdir(checkout)
    cfg = build_config({}, SHARED + ["data.source=files", f"data.paths=[{path}]"])
    with pytest.raises(SubmitError, match=r"^data.paths: .* relative, .*not uploaded") as err:
        place_directories(cfg, "http://10.1.2.3:8265", checkout)
    assert "\n" not in str(err.value) and path in str(err.value)
    # inside the checkout it travels as written; on a local cluster it is made absolute
    ok = build_config({}, SHARED + ["data.source=files", "data.paths=[data/*.txt, ./data/a.txt]"])
    assert place_directories(ok, "http://10.1.2.3:8265", checkout).data.paths == ["data/*.txt", "./data/a.txt"]
    assert place_directories(cfg, "http://127.0.0.1:8265", checkout).data.paths[0].startswith(str(tmp_path))


def test_a_relative_teacher_folder_is_placed_like_the_data(tmp_path, monkeypatch):
    """A local teacher (and its tokenizer) given relative: on a local cluster it was left relative and resolved
    inside Ray's copy of the working directory; for a remote cluster one outside the upload passed, then was not
    found on the cluster (looked up as a hub id). Now made absolute (local) or refused in one line (remote)."""
    import json

    checkout = tmp_path / "checkout"
    for d in (tmp_path / "my-pythia", checkout / "models" / "pythia"):
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_hidden_layers": 2}))
    monkeypatch.chdir(checkout)
    outside = build_config({}, SHARED + ["teacher.name_or_path=../my-pythia"])
    with pytest.raises(SubmitError, match=r"^teacher.name_or_path: '../my-pythia' relative, outside") as err:
        place_directories(outside, "http://10.1.2.3:8265", checkout)
    assert "\n" not in str(err.value)
    placed = place_directories(outside, "http://127.0.0.1:8265", checkout)
    assert placed.teacher.name_or_path == str(tmp_path / "my-pythia")
    assert placed.tokenizer.name_or_path == str(tmp_path / "my-pythia")  # (the teacher's own tokenizer)
    inside = build_config({}, SHARED + ["teacher.name_or_path=models/pythia"])
    assert place_directories(inside, "http://10.1.2.3:8265", checkout).teacher.name_or_path == "models/pythia"
    hub = build_config({}, SHARED + ["teacher.name_or_path=EleutherAI/pythia-70m"])
    assert place_directories(hub, "http://127.0.0.1:8265", checkout).teacher.name_or_path == "EleutherAI/pythia-70m"
