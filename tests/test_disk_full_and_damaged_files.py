"""What happens when things go wrong: a full disk or a read-only place while a run writes its checkpoints, metrics,
results, report, model, data or teacher cache; checkpoints damaged by hand; a non-finite update; a torn metrics line;
a damaged results.json; a lock left by a killed process. Each failure is one line naming the file and what to do,
the previous good files stay whole, and a rerun finishes as an uninterrupted run does."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")

REPO = Path(__file__).resolve().parents[1]


def _enospc(name):
    return OSError(errno.ENOSPC, "No space left on device", str(name))


def _one_line(err) -> str:
    msg = str(err)
    assert msg and "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------ tiny stage-2 runs (as tests/train/test_engine_resume)


def _student(seed=0, vocab=96):
    from transformers import GPTNeoXForCausalLM

    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    return to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval())


def _source():
    from hmscale.train.data import ArraySource

    return ArraySource(np.random.default_rng(1).integers(0, 96, size=(48, 32)))


def _cfg(*extra):
    from hmscale.config import build_config

    return build_config({}, ["stage2.steps=6", "stage2.micro_batch_size=4", "stage2.warmup_steps=2", "stage2.lr=3e-3",
                             "parallel.checkpoint_every=2", "parallel.zero_stage=2", *extra])


def _stage2(out, **kw):
    from hmscale.train.stage2 import run_stage2

    return run_stage2(_cfg(), out, student=_student(seed=kw.pop("seed", 0)), source=_source(), export=False, **kw)


@pytest.fixture(scope="module")
def stage2_runs(tmp_path_factory):
    """An uninterrupted 6-step stage 2, and one stopped after its step-4 checkpoint (steps 2 and 4 kept)."""
    base = tmp_path_factory.mktemp("stage2")
    full = _stage2(base / "full")
    _stage2(base / "cut", stop_at_step=4)
    return full, base / "cut"


def _steps(run):
    return sorted(p.name for p in (run / "stage2" / "checkpoints").iterdir())


def test_a_full_disk_while_checkpointing_is_one_line_and_the_rerun_resumes(tmp_path, monkeypatch, stage2_runs):
    """ENOSPC in DeepSpeed's torch.save or in meta.json: one line naming the checkpoint, what to free and the good
    checkpoint kept (it was a raw OSError traceback); the half-written step directory is gone; the rerun after space
    is freed resumes from step 2 and trains the uninterrupted run's losses."""
    from hmscale.train.engine import StorageError, TrainingError, read_metrics

    full, _ = stage2_runs
    real_save, real_mkstemp = torch.save, tempfile.mkstemp

    def torch_save(obj, f, *a, **k):
        if "step_00000004" in str(f):
            raise _enospc(f)
        return real_save(obj, f, *a, **k)

    def mkstemp(*a, **k):
        if k.get("prefix", "").startswith(".meta.json.") and "step_00000004" in str(k.get("dir")):
            raise _enospc(Path(k["dir"]) / (k["prefix"] + "x.tmp"))
        return real_mkstemp(*a, **k)

    for name, target, fake in (("torch", torch, torch_save), ("meta", tempfile, mkstemp)):
        run = tmp_path / name
        with monkeypatch.context() as m:
            m.setattr(target, "save" if name == "torch" else "mkstemp", fake)
            with pytest.raises(StorageError) as err:
                _stage2(run)
        msg = _one_line(err.value)
        assert isinstance(err.value, TrainingError)  # `hmscale run` / `stage2` print it as their one line (exit 1)
        assert msg.startswith("stage2: writing checkpoint step_00000004") and "No space left on device" in msg, msg
        assert "free space" in msg and str(run / "stage2" / "checkpoints") in msg, msg
        assert "step_00000002 is kept" in msg, msg
        assert _steps(run) == ["step_00000002"]  # no half checkpoint to take space or to be mistaken for one
        rest = _stage2(run, seed=5)
        assert rest["start_step"] == 2 and rest["done"]
        assert [r["loss"] for r in read_metrics(run / "stage2" / "metrics.jsonl")] == pytest.approx(full["losses"], rel=1e-6)


def _damage(kind, ck: Path):
    state = ck / "state"
    if kind == "truncated model file":
        f = state / "mp_rank_00_model_states.pt"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif kind == "deleted optimizer file":
        (state / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    elif kind == "meta.json not JSON":
        (ck / "meta.json").write_text("{oops")
    elif kind == "meta.json another step":
        meta = json.loads((ck / "meta.json").read_text())
        (ck / "meta.json").write_text(json.dumps({**meta, "step": 5}))
    elif kind == "state removed":
        shutil.rmtree(state)


def test_a_damaged_latest_checkpoint_is_passed_over_for_the_one_before(tmp_path, capsys, stage2_runs):
    """A file of the newest checkpoint truncated or deleted, or its meta.json edited: the stage resumes from the
    checkpoint before it, saying so in one line, and trains the uninterrupted run's losses (it raised torch's
    multi-line 'PytorchStreamReader failed', a bare AssertionError or JSONDecodeError, or a wrong 'another layout
    (ZeRO 0 -> 2)' refusal)."""
    from ray_jobs.distill import pick_resume_point

    full, cut = stage2_runs
    for kind in ("truncated model file", "deleted optimizer file", "meta.json not JSON", "meta.json another step",
                 "state removed"):
        run = tmp_path / kind.replace(" ", "_")
        shutil.copytree(cut, run)
        _damage(kind, run / "stage2" / "checkpoints" / "step_00000004")
        capsys.readouterr()
        # what `hmscale run` resumes from (ray_jobs.distill), and the stage's own choice
        assert pick_resume_point(run, None, {}) == ("stage2", run / "stage2" / "checkpoints" / "step_00000002"), kind
        rest = _stage2(run, seed=5, resume=True)
        assert rest["start_step"] == 2 and rest["losses"] == pytest.approx(full["losses"][2:], rel=1e-6), kind
        lines = [l for l in capsys.readouterr().err.splitlines() if "is damaged" in l]
        assert lines and "step_00000004" in lines[0], (kind, lines)
        assert _steps(run) == ["step_00000004", "step_00000006"]  # the damaged step was written again, whole


def test_a_checkpoint_damaged_in_place_is_refused_in_one_line(tmp_path, stage2_runs):
    """Bytes overwritten with the size unchanged (no size check sees it): resuming from it stops with one line naming
    the checkpoint and what to do, never a traceback, never training from what was read."""
    from hmscale.train.engine import TrainingError

    _, cut = stage2_runs
    run = tmp_path / "run"
    shutil.copytree(cut, run)
    f = run / "stage2" / "checkpoints" / "step_00000004" / "state" / "mp_rank_00_model_states.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 3: len(data) // 3 + 4096] = bytes(4096)
    data[-200:] = bytes(200)  # the zip's central directory
    f.write_bytes(bytes(data))
    with pytest.raises(TrainingError) as err:
        _stage2(run, seed=5, resume_from=f.parent.parent, resume=False)
    msg = _one_line(err.value)
    assert "step_00000004" in msg and "could not be loaded" in msg and "delete it" in msg, msg


class _Out:
    def __init__(self, logits):
        self.logits = logits


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


class _BlowUpLM(nn.Module):
    """A finite loss whose gradient is infinite at one step (an overflow in the backward)."""

    def __init__(self, state, bad_step=3, vocab=96):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.state, self.bad_step = nn.Embedding(vocab, 16), nn.Linear(16, vocab), state, bad_step

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids):
        z = self.head(self.emb(input_ids))
        if self.state["step"] == self.bad_step and torch.is_grad_enabled():
            z = _InfGrad.apply(z)
        return _Out(z)


def test_a_non_finite_update_is_never_checkpointed(tmp_path):
    """ZeRO 0 applies an infinite gradient (no overflow skip): the weights turn NaN. The run checkpointed them at
    step 4 and then stopped on the NaN loss naming step_00000004 as 'the weights before this step', so every rerun
    resumed the NaN weights and stopped again. Now it stops at the step that broke them, before any checkpoint of
    them; the good step-2 checkpoint is the one named and resumed; the rerun repeats it with the same one line, which
    says what to change."""
    from hmscale.train.engine import NonFiniteLoss, read_metrics
    from hmscale.train.stage2 import run_stage2

    state = {"step": -1}
    cfg = _cfg("parallel.zero_stage=0")
    msgs = []
    for _ in range(2):
        with pytest.raises(NonFiniteLoss) as err:
            run_stage2(cfg, tmp_path, model=_BlowUpLM(state), source=_source(), export=False,
                       fault_hook=lambda s: state.update(step=s))
        msgs.append(_one_line(err.value))
        assert _steps(tmp_path) == ["step_00000002"]
    assert msgs[0] == msgs[1]
    assert "step 3" in msgs[0] and "step_00000002" in msgs[0] and "lower the learning rate" in msgs[0], msgs[0]
    recs = read_metrics(tmp_path / "stage2" / "metrics.jsonl")  # (step 3's loss was finite: its update was not)
    assert [r["step"] for r in recs] == [0, 1, 2, 3] and not np.isfinite(recs[3]["grad_norm"])


def test_metrics_on_a_full_disk_and_a_torn_last_line(tmp_path, monkeypatch):
    """A full disk while appending to metrics.jsonl is one line (it was an OSError traceback); the torn line it (or a
    kill) leaves is dropped by the resume, and read_metrics skips it rather than raising JSONDecodeError."""
    import builtins

    from hmscale.train.engine import MetricsLogger, StorageError, read_metrics

    log = MetricsLogger(tmp_path, "stage2", 10, progress=False, tensorboard=False)
    for s in range(3):
        log.log(s, {"loss": 1.0 / (s + 1)})
    real_open = builtins.open

    def full_open(f, mode="r", *a, **k):
        if str(f).endswith("metrics.jsonl") and "a" in mode:
            with real_open(f, mode, *a, **k) as fh:
                fh.write('{"kind": "train", "st')  # what fits before the disk is full
            raise _enospc(f)
        return real_open(f, mode, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", full_open)
        with pytest.raises(StorageError) as err:
            log.log(3, {"loss": 0.25})
    msg = _one_line(err.value)
    assert "metrics.jsonl" in msg and "No space left on device" in msg and "free space" in msg, msg
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]  # the torn line skipped
    resumed = MetricsLogger(tmp_path, "stage2", 10, start_step=2, progress=False, tensorboard=False)
    resumed.log(2, {"loss": 0.5})
    resumed.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines] == [0, 1, 2]


# ------------------------------------------------------------------ the recipe's own files


def test_a_damaged_results_json_is_one_line(tmp_path):
    """results.json that is not JSON (or not the recipe's object): one line naming it and what to do (it was a
    JSONDecodeError / KeyError traceback)."""
    from hmscale.config import build_config
    from hmscale.recipe import RecipeError, run_recipe

    cfg = build_config({}, [f"output_dir={tmp_path}", "parallel.engine=local"])
    for text in ('{"config_hash": "ab", "stag', "[1, 2]", '{"config_hash": "x"}'):
        (tmp_path / "results.json").write_text(text)
        with pytest.raises(RecipeError) as err:
            run_recipe(cfg, log=lambda *a: None)
        msg = _one_line(err.value)
        assert str(tmp_path / "results.json") in msg and "damaged" in msg and "rerun" in msg, msg


def test_a_read_only_output_dir_is_one_line(tmp_path, monkeypatch):
    """A run directory this user cannot write (a read-only mount): one line naming output_dir before anything is
    written (it was a PermissionError traceback from config.yaml). Simulated: the suite may run as root."""
    from hmscale import atomic
    from hmscale.config import build_config
    from hmscale.recipe import RecipeError, run_recipe

    run = tmp_path / "run"
    run.mkdir()
    real_access, real_open = os.access, os.open

    def access(path, mode, *a, **k):
        return False if Path(path) == run and mode & os.W_OK else real_access(path, mode, *a, **k)

    def ro_open(path, flags, *a, **k):
        if str(path).startswith(str(run)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(atomic.os, "access", access)
    monkeypatch.setattr(os, "open", ro_open)
    cfg = build_config({}, [f"output_dir={run}", "parallel.engine=local"])
    with pytest.raises(RecipeError) as err:
        run_recipe(cfg, log=lambda *a: None)
    msg = _one_line(err.value)
    assert msg.startswith(f"output_dir: {run}: not writable by this user"), msg


def test_atomic_writes_name_the_file_on_a_full_disk(tmp_path, monkeypatch):
    """The error of a full disk names the file asked for, not the hidden temporary (what the user knows); the
    previous version stays whole and no temporary is left."""
    from hmscale.atomic import atomic_write_json, os_error_line

    path = tmp_path / "results.json"
    atomic_write_json(path, {"a": 1})
    real = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:3])
            raise OSError(errno.ENOSPC, "No space left on device")  # (a write names no file)

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Full(real(fd, mode)))
    with pytest.raises(OSError) as err:
        atomic_write_json(path, {"a": 2})
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert json.loads(path.read_text()) == {"a": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    msg = os_error_line(err.value)
    assert msg.startswith(f"writing {path} failed: No space left on device; free space on the filesystem of {tmp_path}")


def test_a_full_disk_while_the_stream_is_written_raises_instead_of_sigbus(tmp_path, monkeypatch):
    """The split's tokens.npy was filled through a memory map of a sparse file: on a full disk a store into a mapped
    page kills the process with SIGBUS (no message, nothing cleaned). Written with plain writes, a full disk is an
    OSError (the recipe's one line) and the file holds np.save's bytes."""
    import builtins

    from hmscale.data.bundle import _StreamWriter

    tokens = np.arange(5000, dtype=np.int32)
    w = _StreamWriter(tmp_path, "train")
    w.append(tokens, np.array([5000]))
    w.checkpoint()
    real_open = builtins.open

    class Quota:  # a filesystem that takes 1 KiB more, then reports ENOSPC to write() (and SIGBUS to a mapped store)
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += memoryview(b).nbytes
            if self.n > 1024:
                raise _enospc(self.f.name)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def quota_open(f, mode="r", *a, **k):
        fh = real_open(f, mode, *a, **k)
        return Quota(fh) if str(f).endswith("train.tokens.npy") and "w" in mode else fh

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", quota_open)
        with pytest.raises(OSError) as err:
            w.close()
    assert err.value.errno == errno.ENOSPC
    w2 = _StreamWriter(tmp_path, "train", resume={"tokens": 5000, "documents": 1})  # the rerun resumes the split
    w2.close()
    ref = tmp_path / "ref.npy"
    np.save(ref, tokens)
    assert (tmp_path / "train.tokens.npy").read_bytes() == ref.read_bytes()


def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path):
    """flock dies with its holder: a cache build lock whose process was SIGKILLed is taken at once, without waiting."""
    from hmscale.atomic import exclusive_lock

    lock = tmp_path / ".locks" / "v1-x.lock"
    code = ("import sys, time; sys.path.insert(0, %r)\nfrom hmscale.atomic import exclusive_lock\n"
            "with exclusive_lock(%r):\n    print('held', flush=True); time.sleep(60)\n") % (str(REPO), str(lock))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert lock.exists()
    waited = []
    with exclusive_lock(lock, lambda: waited.append(1)) as w:
        assert w is False and not waited


# ------------------------------------------------------------------ a whole tiny recipe run


def _recipe_overrides(root: Path, run: Path):
    return ["teacher.flavor=pythia-nano", "teacher.pretrain_steps=4", "teacher.pretrain_batch_size=8",
            "tokenizer.vocab_size=512", "data.seq_len=64", "data.sequences_per_shard=16", "data.max_documents=40",
            f"data.cache_dir={root / 'data'}", f"cache.root={root / 'cache'}", "cache.max_tokens=2048",
            "cache.capture.dtype=float32", "cache.capture.topk=8", "cache.engine=local",
            "stage1.steps=4", "stage1.micro_batch_size=4", "stage2.steps=4", "stage2.micro_batch_size=4",
            "stage2.kd_weight=0.5", "eval.max_sequences=4", "parallel.checkpoint_every=2",
            f"output_dir={run}", "parallel.engine=local", "eval.generate_tokens=0"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished tiny `hmscale run` (data, teacher, cache, both stages, eval, report): its root and results."""
    from hmscale.config import build_config
    from hmscale.recipe import run_recipe

    root = tmp_path_factory.mktemp("recipe")
    res = run_recipe(build_config({}, _recipe_overrides(root, root / "run")), log=lambda *a: None)
    return root, res


def _ppl(res):
    return {k: v for k, v in res.items() if k.endswith("_ppl")}


def test_recipe_writes_on_a_full_disk_are_one_line_and_the_rerun_finishes(finished_run, monkeypatch):
    """A full disk while the rerun rewrites report.md, or copies the model into model/: one line naming the file and
    what to free (the model copy was shutil.Error's list of tuples, a traceback); report.md keeps its previous
    bytes; the rerun after space is freed ends with the same results."""
    from hmscale.config import build_config
    from hmscale.recipe import run_recipe
    from hmscale.train.engine import StorageError

    root, res = finished_run
    run = root / "run"
    cfg = build_config({}, _recipe_overrides(root, run))
    report = (run / "report.md").read_bytes()
    real_mkstemp, real_copyfile = tempfile.mkstemp, shutil.copyfile

    def mkstemp(*a, **k):
        if k.get("prefix", "").startswith(".report.md."):
            raise _enospc(Path(k["dir"]) / (k["prefix"] + "x.tmp"))
        return real_mkstemp(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkstemp", mkstemp)
        with pytest.raises(StorageError) as err:
            run_recipe(cfg, log=lambda *a: None)
    msg = _one_line(err.value)
    assert msg.startswith(f"writing {run / 'report.md'} failed: No space left on device; free space"), msg
    assert "rerun `hmscale run`" in msg
    assert (run / "report.md").read_bytes() == report

    # the evaluation redone (other eval settings) on a fresh copy of the model, whose copy fills the disk
    shutil.rmtree(run / "model")
    results = json.loads((run / "results.json").read_text())
    del results["stages"]["eval"]
    (run / "results.json").write_text(json.dumps(results))

    def copyfile(src, dst, *a, **k):
        if ".model.tmp" in str(dst):
            raise _enospc(dst)
        return real_copyfile(src, dst, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(shutil, "copyfile", copyfile)
        with pytest.raises(StorageError) as err:
            run_recipe(cfg, log=lambda *a: None)
    msg = _one_line(err.value)
    assert ".model.tmp" in msg and "No space left on device" in msg, msg
    assert not (run / "model").exists()
    again = run_recipe(cfg, log=lambda *a: None)
    assert _ppl(again) == _ppl(res)


def test_a_cache_error_under_hmscale_run_is_one_line(finished_run, monkeypatch, tmp_path):
    """A full disk while `hmscale run` writes a teacher-cache shard: the cache's own one line, as a TrainingError that
    `hmscale run` prints (it was a bare CacheError, which `hmscale run` does not catch: a traceback); the shards
    written are kept and the rerun finishes with the same results."""
    from hmscale.config import build_config
    from hmscale.recipe import run_recipe
    from hmscale.teacher.cache import writer
    from hmscale.train.engine import TrainingError

    root, res = finished_run
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    (cache_dir,) = [p for p in cache.iterdir() if p.name.startswith("v1-")]
    shards = sorted(cache_dir.glob("shard-*.tar"))
    shards[0].unlink()
    over = [o for o in _recipe_overrides(root, tmp_path / "run") if not o.startswith("cache.root=")]
    cfg = build_config({}, over + [f"cache.root={cache}"])

    def full(self, mv):
        raise _enospc(None)

    with monkeypatch.context() as m:
        m.setattr(writer._HashingSink, "_out", full)
        with pytest.raises(TrainingError) as err:
            run_recipe(cfg, log=lambda *a: None)
    msg = _one_line(err.value)
    assert shards[0].name in msg and "No space left on device" in msg and "free space" in msg, msg
    assert all(p.exists() for p in shards[1:])
    assert _ppl(run_recipe(cfg, log=lambda *a: None)) == _ppl(res)


def test_a_finished_cache_in_a_read_only_root_is_read(finished_run, monkeypatch):
    """A finished teacher cache this user may only read (another user's shared cache root, a read-only mount): a run
    reads it as it is (it was refused: 'not writable by this user; set cache.root to a directory you can write');
    a cache that lacks a shard still gets the one line."""
    from hmscale import atomic
    from hmscale.config import build_config
    from hmscale.teacher.cache import CacheError, build_cache

    root, _ = finished_run
    cfg = build_config({}, _recipe_overrides(root, root / "run"))
    cache = Path(cfg.cache.root)
    real = os.access
    monkeypatch.setattr(atomic.os, "access", lambda p, mode, *a, **k: (
        False if str(p).startswith(str(cache)) and mode & os.W_OK else real(p, mode, *a, **k)))
    logs = []
    got = build_cache(cfg, log=logs.append)
    assert got.parent == cache and any("read-only here" in l for l in logs), logs
    victim = sorted(got.glob("shard-*.tar"))[0]
    saved = victim.read_bytes()
    victim.write_bytes(saved[:-10])
    try:
        with pytest.raises(CacheError) as err:
            build_cache(cfg, log=lambda *a: None)
    finally:
        victim.write_bytes(saved)
    assert "not writable by this user" in _one_line(err.value)


def test_stage_commands_and_prepare_report_a_full_disk_in_one_line(tmp_path, monkeypatch, capsys):
    """`hmscale stage1 / stage2` and `hmscale prepare` printed a traceback when a write hit a full disk."""
    import errno

    import ray_jobs.distill
    from hmscale import data as data_pkg
    from hmscale.cli import main

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "stage1" / "summary.json"))

    monkeypatch.setattr(ray_jobs.distill, "run_distill", full)
    rc = main(["stage1", "-s", f"output_dir={tmp_path / 'run'}", "-s", "parallel.engine=local"])
    err = capsys.readouterr().err
    assert rc == 1 and "summary.json failed: No space left on device; free space" in err and "Traceback" not in err
    assert "rerun `hmscale stage1`" in err
    monkeypatch.setattr(data_pkg, "prepare_data", full)
    rc = main(["prepare", "-s", f"data.cache_dir={tmp_path / 'd'}"])
    err = capsys.readouterr().err
    assert rc == 1 and "No space left on device; free space" in err and "rerun `hmscale prepare`" in err


def test_save_resolved_leaves_no_temporary_on_a_full_disk(tmp_path, monkeypatch):
    import errno
    import os

    from hmscale.config import build_config, save_resolved

    real = os.fsync

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space left"):
        save_resolved(build_config({}), tmp_path)
    monkeypatch.setattr(os, "fsync", real)
    assert list(tmp_path.iterdir()) == []
