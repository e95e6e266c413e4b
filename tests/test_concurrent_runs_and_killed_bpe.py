"""Kills at random moments, then the same `hmscale run` again: concurrent runs of one output_dir, a killed BPE.

Two `hmscale run`s of one config into one output_dir at once (a rerun started while the killed run's second rerun, or
another shell's, is still going) both trained into the same stage directories side by side: metrics.jsonl held every
step twice, two TensorBoard logs, both saving the same checkpoints, and the later one's start removed the
temporaries of the other's live atomic writes. The second must wait for the first (then skip what it finished)."""

import threading
from pathlib import Path
from types import SimpleNamespace


class _Stop(Exception):
    pass


def _cfg(tmp_path: Path):
    from hmscale.config import build_config

    return build_config({}, ["teacher.flavor=pythia-nano", "cache.engine=local", "parallel.engine=local",
                             f"data.cache_dir={tmp_path / 'data'}", f"cache.root={tmp_path / 'cache'}",
                             f"output_dir={tmp_path / 'run'}"])


def test_a_second_run_of_one_output_dir_waits_for_the_first(tmp_path, monkeypatch):
    """The data, teacher and training are stubbed: the first run is held inside its training; the second, started
    then, must not enter it (it waits, saying so), and enters it once the first has ended."""
    import ray_jobs.distill as distill
    from hmscale.recipe import run_recipe

    cfg = _cfg(tmp_path)
    prep = {"data": SimpleNamespace(plan=SimpleNamespace(total_tokens=1), val_tokens=[0], vocab_size=8),
            "teacher": None, "cache_dir": str(tmp_path / "cache")}
    inside, most = [], [0]
    first_in, second_moved, release = threading.Event(), threading.Event(), threading.Event()
    lock = threading.Lock()

    def fake_distill(cfg, run_dir, log=print, prepared=None):
        with lock:
            inside.append(threading.current_thread().name)
            most[0] = max(most[0], len(inside))
        if threading.current_thread().name == "second":
            second_moved.set()
        first_in.set()
        try:
            release.wait(30)
        finally:
            with lock:
                inside.remove(threading.current_thread().name)
        raise _Stop

    monkeypatch.setattr(distill, "prepare", lambda cfg, log=print, check_data=None, stages=None: prep)
    monkeypatch.setattr(distill, "run_distill", fake_distill)
    logs = {"first": [], "second": []}
    errors = {}

    def go(name):
        def log(*a):
            logs[name].append(" ".join(map(str, a)))
            if name == "second" and "waiting" in logs[name][-1]:
                second_moved.set()
        try:
            run_recipe(cfg, log=log)
        except BaseException as err:  # noqa: BLE001
            errors[name] = err

    first = threading.Thread(target=go, args=("first",), name="first")
    first.start()
    assert first_in.wait(30)
    second = threading.Thread(target=go, args=("second",), name="second")
    second.start()
    try:
        assert second_moved.wait(30)  # it either waits (logged) or went into the training beside the first
        assert most[0] == 1, f"two runs trained in {cfg.output_dir} at once"
        assert inside == ["first"]
        line = next(x for x in logs["second"] if "waiting" in x)
        assert str(Path(cfg.output_dir).resolve()) in line and "\n" not in line, line
    finally:
        release.set()
        first.join(30)
        second.join(30)
    assert isinstance(errors.get("first"), _Stop) and isinstance(errors.get("second"), _Stop), errors
    assert most[0] == 1
    # the second resumed what the first recorded: prepare skipped
    assert any("prepare: already done" in x for x in logs["second"]), logs["second"]


def test_a_tokenizer_training_killed_mid_way_leaves_no_temporary_after_the_rerun(tmp_path):
    """A SIGKILL while the byte-level BPE trained (`hmscale run`'s first seconds) left its temporary directory
    `tokenizers/.bpe<V>-<key>.tmp-<pid>-<random>/` in data.cache_dir for good: the rerun trained into a new one and
    nothing removed the dead one. The rerun of an interrupted training takes its place."""
    import subprocess
    import sys

    from hmscale.data.sources import EmbeddedSource
    from hmscale.data.tokenizer import trained_tokenizer

    code = (
        "import os, hmscale.data.tokenizer as t\n"
        "from hmscale.data.sources import EmbeddedSource\n"
        "def dies(texts, vocab):\n"
        "    os._exit(9)  # as SIGKILL mid-training: no cleanup runs\n"
        "t.train_bpe = dies\n"
        f"t.trained_tokenizer(EmbeddedSource(val_fraction=0.1, max_documents=12), 300, {str(tmp_path)!r}, log=print)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 9, p.stderr[-2000:]
    tok_dir = tmp_path / "tokenizers"
    assert not any((d / "tokenizer.json").exists() for d in tok_dir.iterdir() if not d.name.startswith("."))

    tok = trained_tokenizer(EmbeddedSource(val_fraction=0.1, max_documents=12), 300, tmp_path, log=lambda *a: None)
    assert len(tok) == 300
    names = sorted(p.name for p in tok_dir.iterdir())
    assert len(names) == 1 and not names[0].startswith("."), names  # the entry only: no dead temporary beside it
