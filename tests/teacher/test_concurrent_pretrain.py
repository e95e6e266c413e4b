"""Concurrent runs sharing data.cache_dir and a miniature teacher not yet pretrained: one pretrains and stores it, the
others wait and reuse it (each pretrained its own before, and all but the first rename threw theirs away, logging
"stored at" with the perplexity of a teacher they did not use); a pretraining killed with -9 leaves nothing that a
later run trusts or that stays behind."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import hmscale.teacher.pretrain as pretrain_mod
from hmscale.config import build_config
from hmscale.data import prepare_data
from hmscale.teacher import get_teacher, teacher_cache_dir

OVERRIDES = ["teacher.flavor=pythia-nano", "tokenizer.vocab_size=300", "data.seq_len=32", "data.max_documents=12",
             "data.sequences_per_shard=8", "teacher.pretrain_steps=3", "teacher.pretrain_batch_size=8"]


@pytest.fixture()
def cfg_data(tmp_path):
    cfg = build_config({}, OVERRIDES + [f"data.cache_dir={tmp_path / 'data'}"])
    return cfg, prepare_data(cfg, log=lambda *a: None)


def _states_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_concurrent_runs_pretrain_once_and_share_the_teacher(cfg_data, monkeypatch):
    cfg, data = cfg_data
    orig = pretrain_mod.pretrain_teacher
    calls, started = [], threading.Event()

    def slow_pretrain(*a, **k):  # each pretraining a different teacher (a time budget's outcome differs per run)
        calls.append(threading.current_thread().name)
        started.set()
        model, stats = orig(*a, **k)
        with torch.no_grad():
            next(model.parameters()).add_(float(len(calls)))
        time.sleep(1.5)  # the other run arrives while this one is still pretraining
        return model, stats

    monkeypatch.setattr(pretrain_mod, "pretrain_teacher", slow_pretrain)
    results, logs, errors = {}, {"a": [], "b": []}, []

    def run(name):
        try:
            results[name] = get_teacher(cfg, data, log=logs[name].append)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    a = threading.Thread(target=run, args=("a",), name="a")
    a.start()
    assert started.wait(60)
    b = threading.Thread(target=run, args=("b",), name="b")
    b.start()
    a.join(120)
    b.join(120)
    assert not errors and set(results) == {"a", "b"}
    assert calls == ["a"], f"pretrained {len(calls)} times: {calls}"
    assert _states_equal(results["a"], results["b"])
    assert any("stored at" in line for line in logs["a"])
    assert not any("stored at" in line or "validation perplexity" in line for line in logs["b"]), logs["b"]
    target = teacher_cache_dir(cfg, data)
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_a_pretraining_killed_midway_leaves_nothing_trusted_or_behind(cfg_data, tmp_path):
    cfg, data = cfg_data
    target = teacher_cache_dir(cfg, data)
    script = textwrap.dedent(f"""
        import os, signal
        import hmscale.teacher.pretrain as pm
        from hmscale.config import build_config
        from hmscale.data import prepare_data
        from hmscale.teacher import get_teacher

        orig = pm.pretrain_teacher
        def killed(*a, **k):
            model, stats = orig(*a, **k)
            model.save_pretrained = lambda d: (open(os.path.join(d, "config.json"), "w").write("{{"),
                                               os.kill(os.getpid(), signal.SIGKILL))  # dies mid-save
            return model, stats
        pm.pretrain_teacher = killed
        cfg = build_config({{}}, {OVERRIDES + [f"data.cache_dir={tmp_path / 'data'}"]!r})
        get_teacher(cfg, prepare_data(cfg, log=lambda *a: None), log=lambda *a: None)
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not target.exists()  # the torn config.json is not where a run looks
    logs = []
    model = get_teacher(cfg, data, log=logs.append)  # pretrains again, complete
    assert any("stored at" in line for line in logs)
    assert (target / "config.json").read_text().startswith("{") and model.config.vocab_size >= data.vocab_size
    left = [p.name for p in target.parent.iterdir() if p != target]
    assert left == [], f"an interrupted pretraining's leftovers stay: {left}"
