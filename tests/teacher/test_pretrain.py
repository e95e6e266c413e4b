"""Tiny-teacher pretraining beats a unigram model by a wide margin; get_teacher stores and reuses it."""

import numpy as np
import pytest
import torch

from hmscale.config import build_config
from hmscale.data import prepare_data
from hmscale.teacher import get_teacher, teacher_cache_dir
from hmscale.teacher.fingerprint import teacher_fingerprint
from hmscale.eval.perplexity import unigram_perplexity
from hmscale.teacher.pretrain import lr_at, pretrain_teacher


@pytest.fixture(scope="module")
def cfg_data(tmp_path_factory):
    cfg = build_config({
        "teacher": {"flavor": "pythia-nano", "pretrain_steps": 150, "pretrain_seconds": 300, "pretrain_lr": 3e-3,
                    "pretrain_batch_size": 8},
        "tokenizer": {"vocab_size": 512},
        "data": {"max_documents": 150, "seq_len": 128, "cache_dir": str(tmp_path_factory.mktemp("cache"))},
    })
    return cfg, prepare_data(cfg, log=lambda *a: None)


@pytest.fixture()
def one_thread():
    # a nano model gains little from a second thread, and one thread degrades far less when
    # other jobs share the two cores
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_pretraining_beats_unigram(cfg_data, one_thread):
    cfg, data = cfg_data
    logs = []
    # a step budget (not a time budget) keeps the outcome independent of how loaded the machine is
    model, stats = pretrain_teacher("pythia-nano", data.vocab_size, data.plan.all_tokens(), steps=120, seconds=300,
                                    lr=3e-3, batch_size=8, seed=0, val_tokens=data.val_tokens, log=logs.append)
    assert stats["steps"] == 120 and not model.training
    assert all(not p.requires_grad for p in model.parameters())
    print(f"\nnano teacher: val ppl {stats['val_ppl']:.1f} vs unigram {stats['unigram_ppl']:.1f} "
          f"in {stats['seconds']:.1f} s ({stats['steps']} steps)")
    assert stats["final_loss"] < stats["first_loss"] - 1.0
    assert stats["val_ppl"] < 0.6 * stats["unigram_ppl"]
    assert any("unigram" in m for m in logs)


def test_time_limit_stops_training(cfg_data):
    _, data = cfg_data
    _, stats = pretrain_teacher("pythia-nano", data.vocab_size, data.plan.all_tokens()[:64], steps=10_000, seconds=0.5,
                                batch_size=2, log=lambda *a: None)
    assert 0 < stats["steps"] < 10_000 and stats["seconds"] < 5


def test_schedule():
    lrs = [lr_at(s, s / 100, 1.0, warmup=10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and max(lrs) == pytest.approx(1.0, abs=0.01)
    assert lrs[-1] < 0.11 and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    # a time budget that runs out early also ends the warmup and the decay
    assert lr_at(2, 0.5, 1.0, warmup=100) == pytest.approx(0.55)


def test_unigram_perplexity():
    train = np.array([[0, 1, 1, 1]])
    assert unigram_perplexity(train, np.array([[0, 1, 1]]), 2, smoothing=0) == pytest.approx(4 / 3)


def test_get_teacher_stores_and_reuses(cfg_data, one_thread):
    cfg, data = cfg_data
    cfg = cfg.model_copy(deep=True)
    cfg.teacher.pretrain_steps = 5
    logs = []
    first = get_teacher(cfg, data, log=logs.append)
    target = teacher_cache_dir(cfg, data)
    assert (target / "config.json").exists() and (target / "pretrain_stats.json").exists()
    assert (target / "tokenizer.json").exists()  # the stored teacher directory is self-contained
    assert not first.training and all(not p.requires_grad for p in first.parameters())
    assert first.config.vocab_size == data.vocab_size
    logs.clear()
    second = get_teacher(cfg, data, log=logs.append)
    assert any("reusing" in m for m in logs) and not any("pretraining" in m for m in logs)
    assert teacher_fingerprint(second) == teacher_fingerprint(first)
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    other = cfg.model_copy(deep=True)
    other.seed = 1
    assert teacher_cache_dir(other, data) != target
