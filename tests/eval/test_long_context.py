"""Long-context evaluation: rows from long documents, position buckets, segmented = whole-row scoring."""

import math

import numpy as np
import pytest
import torch
from transformers import GPTNeoXForCausalLM

from hmscale.eval import mean_nll
from hmscale.eval.long_context import (bucket_edges, bucket_perplexities, long_context_eval, long_context_rows,
                                       long_context_table, position_nll)
from hmscale.models.convert import to_hedgehog, to_hedgemamba
from hmscale.teacher.flavors import neox_config

VOCAB = 97


def make_model():
    """A tiny HedgeMamba whose decay, dt, conv and gate are away from their identity init (state carries matter)."""
    torch.manual_seed(0)
    model = to_hedgemamba(to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=VOCAB)).eval())).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("conv.", "dt_proj", "A_scale", "z_proj")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        for layer in model.backbone.layers:
            layer.mixer.A_scale.abs_()
    return model


def _stream(tmp_path, lens, split="validation", seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 1000, size=int(np.sum(lens)), dtype=np.int32)
    np.save(tmp_path / f"{split}.tokens.npy", tokens)
    np.save(tmp_path / f"{split}.doc_lens.npy", np.asarray(lens, dtype=np.int64))
    return tokens


def test_rows_are_prefixes_of_the_long_documents(tmp_path):
    lens = [5, 40, 12, 33, 8, 50]
    tokens = _stream(tmp_path, lens)
    rows, frm = long_context_rows(tmp_path, 30, max_rows=8)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    assert frm == "documents" and rows.shape == (3, 30) and rows.dtype == np.int64
    for row, d in zip(rows, (1, 3, 5)):
        assert np.array_equal(row, tokens[starts[d]:starts[d] + 30])
    assert long_context_rows(tmp_path, 30, max_rows=2)[0].shape == (2, 30)


def test_rows_fall_back_to_the_stream_and_refuse_too_little_data(tmp_path):
    tokens = _stream(tmp_path, [10, 9, 11, 10])
    rows, frm = long_context_rows(tmp_path, 16, max_rows=8)
    assert frm == "stream" and np.array_equal(rows, tokens[:32].reshape(2, 16))
    with pytest.raises(ValueError, match="eval.context_length: the validation split has 40 tokens"):
        long_context_rows(tmp_path, 64, max_rows=8)
    with pytest.raises(ValueError, match="eval.context_length"):
        long_context_rows(tmp_path, 1, max_rows=8)


def test_bucket_edges():
    assert bucket_edges(2048, 256) == [1, 256, 512, 1024, 2048]
    assert bucket_edges(1000, 256) == [1, 256, 512, 1000]
    assert bucket_edges(512, 256) == [1, 256, 512]
    assert bucket_edges(64, 256) == [1, 16, 32, 64]


def test_bucket_perplexities_average_their_positions():
    total = np.array([1.0, 2.0, 3.0, 4.0, 5.0])  # targets at positions 1..5 of rows of 6
    count = np.full(5, 2)
    p = bucket_perplexities(total, count, [1, 3, 6])
    assert p == pytest.approx([math.exp(3.0 / 4), math.exp(12.0 / 6)])


def test_segmented_scoring_equals_the_whole_row(monkeypatch):
    torch.manual_seed(0)
    model = make_model()
    rows = torch.randint(1, VOCAB, (3, 70))
    whole, count = position_nll(model, rows, batch_size=2)
    monkeypatch.setattr("hmscale.eval.long_context._CE_BLOCK", 7)  # the cross-entropy in blocks: the same sums
    np.testing.assert_allclose(position_nll(model, rows, batch_size=2)[0], whole, rtol=1e-6, atol=1e-6)
    monkeypatch.undo()
    for seg in (16, 23, 69):
        part, _ = position_nll(model, rows, batch_size=2, segment=seg)
        np.testing.assert_allclose(part, whole, rtol=1e-5, atol=1e-5)
    assert (count == 3).all() and whole.shape == (69,) and (whole > 0).all()
    # the sum over positions is the perplexity module's mean NLL
    nll, n = mean_nll(model, rows, batch_size=2)
    assert n == 3 * 69 and whole.sum() / n == pytest.approx(nll, rel=1e-6)


def test_segments_need_a_recurrent_cache():
    teacher = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=VOCAB)).eval()
    with pytest.raises(ValueError, match="no recurrent cache"):
        position_nll(teacher, torch.randint(1, VOCAB, (1, 20)), segment=8)


def test_long_context_eval_reports_every_model_and_bucket():
    torch.manual_seed(0)
    teacher = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=VOCAB)).eval()
    student = make_model()
    rows = np.random.default_rng(0).integers(1, VOCAB, size=(3, 96))
    logs = []
    res = long_context_eval({"teacher": teacher, "hedgemamba": student}, rows, train_len=24, tokens_per_batch=200,
                            segment=40, log=logs.append)
    assert res["buckets"] == [[1, 24], [24, 48], [48, 96]] and res["rows"] == 3 and res["length"] == 96
    for name, model in (("teacher", teacher), ("hedgemamba", student)):
        assert len(res["ppl"][name]) == 3 and all(math.isfinite(p) and p > 1 for p in res["ppl"][name])
        assert res["overall_ppl"][name] == pytest.approx(math.exp(mean_nll(model, rows)[0]), rel=1e-5)
    assert len(logs) == 2 and logs[1].startswith("[eval] long context hedgemamba: [1, 24)")
    table = long_context_table(res, {"teacher": "T"})
    assert table[0] == "| model | 1-23 | 24-47 * | 48-95 * |" and table[2].startswith("| T | ")


def test_long_context_eval_logs_progress_while_a_model_scores():
    """Long rows of a large model take minutes per model: a progress line comes (at most every progress_every
    seconds) before the model's result line, and none after its last batch; the scores do not change."""
    student = make_model()
    rows = np.random.default_rng(3).integers(1, VOCAB, size=(5, 64))
    quiet, logs = [], []
    want = long_context_eval({"hedgemamba": student}, rows, train_len=16, tokens_per_batch=128, segment=24,
                             log=quiet.append)
    assert len(quiet) == 1  # progress_every=30 s: a 5-row toy run is done long before
    res = long_context_eval({"hedgemamba": student}, rows, train_len=16, tokens_per_batch=128, segment=24,
                            log=logs.append, progress_every=0)
    assert res == want
    assert [line.rsplit(" in ", 1)[0] for line in logs[:-1]] == [
        f"[eval] long context hedgemamba: {d}/5 rows scored" for d in (2, 4)]
    assert all(line.endswith(" s") for line in logs[:-1])
    assert logs[-1].startswith("[eval] long context hedgemamba: [1, 16)")
    seen = []
    position_nll(student, rows, batch_size=3, progress=lambda done, n: seen.append((done, n)))
    assert seen == [(3, 5), (5, 5)]


def test_scoring_a_model_saved_with_return_dict_false():
    # a model whose config says return_dict=False returns tuples; the scorers ask for the output object
    model = make_model()
    rows = torch.randint(1, VOCAB, (2, 30))
    want = position_nll(model, rows, batch_size=2, segment=8)[0], mean_nll(model, rows)[0]
    model.config.return_dict = False
    got = position_nll(model, rows, batch_size=2, segment=8)[0], mean_nll(model, rows)[0]
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]
