"""A deterministic training error on Ray workers (here: stage 2 without a stage-1 student) is not retried
by Ray Train: every rank reports it and the driver raises it as the same one-line TrainingError. A cluster address
that cannot be joined (nothing there, a refused token) is one line too."""

import pytest


def _ray_init_failing(monkeypatch, cause: BaseException):
    import ray

    def init(*a, **kw):  # what ray.init raises: ConnectionError, from the GCS client's error
        try:
            raise RuntimeError(f"Failed to connect to GCS. Last connection error: {cause}") from cause
        except RuntimeError as inner:
            raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:6379") from inner
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    import hmscale.ray_cluster

    # (ray.init's own failure is the case here: not connect's quick check for a closed port, which would answer first)
    monkeypatch.setattr(hmscale.ray_cluster, "_nothing_listens", lambda address: None)


def _auth_refused():
    from ray.exceptions import AuthenticationError

    return AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing")


@pytest.mark.parametrize("cause, address, says", [
    # a cluster started with RAY_AUTH_MODE=token, joined from a shell without it: Ray retries for ~20 s, then raised
    # a two-exception traceback; the cause (the token) only in its middle
    (_auth_refused, "127.0.0.1:6379", r"parallel.ray_address=127.0.0.1:6379: cannot join the Ray cluster there: it "
                                      r"refused this process's auth token \(RAY_AUTH_MODE is unset\); .*export "
                                      r"RAY_AUTH_MODE=token here too"),
    (lambda: OSError("failed to connect to all addresses"), "10.0.0.1:8265",
     r"parallel.ray_address=10.0.0.1:8265: cannot join the Ray cluster there \(Failed to connect to Ray cluster at "
     r".*\); give the head's GCS address \(HEAD:6379, not the dashboard's http://HEAD:8265\)"),
], ids=["token refused", "nothing there"])
def test_an_unjoinable_cluster_is_one_line(monkeypatch, cause, address, says):
    from hmscale.config import ConfigError
    from hmscale.ray_cluster import connect

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    _ray_init_failing(monkeypatch, cause())
    with pytest.raises(ConfigError, match=says) as err:
        connect(address, log=lambda *a: None)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("command", ["run", "stage1", "cache"])
def test_commands_name_an_unjoinable_ray_address_in_one_line(monkeypatch, capsys, tmp_path, command):
    from hmscale.cli import main

    _ray_init_failing(monkeypatch, OSError("failed to connect to all addresses"))
    rc = main([command, "-s", "parallel.engine=ray", "-s", "parallel.ray_address=192.0.2.2:6379",
               "-s", f"output_dir={tmp_path}/run", "-s", f"data.cache_dir={tmp_path}/d", "-s", f"cache.root={tmp_path}/c"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err, err
    assert err.startswith("hmscale: error: parallel.ray_address=192.0.2.2:6379: cannot join the Ray cluster there")


def test_the_dashboard_url_as_ray_address_is_one_line(monkeypatch):
    # Ray's own error talks of RAY_ADDRESS over three lines, though the user set parallel.ray_address
    import ray

    from hmscale.config import ConfigError
    from hmscale.ray_cluster import connect

    def init(*a, **kw):
        raise ValueError("Invalid Ray address: 'http://127.0.0.1:8265'. It looks like you set RAY_ADDRESS to an HTTP "
                         "address (e.g. the API server address). To fix this, either:\n  1. Unset RAY_ADDRESS ...")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ConfigError, match=r"parallel.ray_address=http://127.0.0.1:8265: cannot join the Ray cluster "
                                          r"there \(Invalid Ray address.*\); give the head's GCS address") as err:
        connect("http://127.0.0.1:8265", log=lambda *a: None)
    assert "\n" not in str(err.value)


@pytest.mark.ray
@pytest.mark.slow
def test_training_error_on_workers_reaches_the_driver(ray_cluster, tmp_path, monkeypatch):
    from hmscale.config import build_config
    from hmscale.train.engine import TrainingError
    from ray_jobs.distill import run_distill

    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    cfg = build_config({}, [
        "teacher.flavor=pythia-nano", "teacher.pretrain_steps=2", "teacher.pretrain_batch_size=4",
        "tokenizer.vocab_size=512", "data.seq_len=64", "data.max_documents=30", f"data.cache_dir={tmp_path / 'data'}",
        "parallel.engine=ray", "parallel.num_workers=2", "parallel.max_failures=3",
    ])
    with pytest.raises(TrainingError, match="no stage-1 student") as err:
        run_distill(cfg, tmp_path / "run", stages=("stage2",), log=lambda *a, **k: None)
    assert "\n" not in str(err.value)
