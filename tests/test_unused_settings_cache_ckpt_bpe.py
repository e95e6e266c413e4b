"""Small defects: settings that do nothing, the cache's advice naming one command of two, a
manifest error hiding the shard error, a damaged Ray-restored checkpoint refused, the BPE's text budget overrun."""

import errno
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from hmscale.config import ConfigError, build_config, load_config, save_resolved

# ---------------------------------------------------------------- 1. settings their switch leaves unused


@pytest.mark.parametrize("overrides, field", [
    (["stage2.lora_alpha=8"], "stage2.lora_alpha"),  # lora_rank is 0: no adapters to scale
    (["stage2.lora_alpha=32", "stage2.lora_rank=0"], "stage2.lora_alpha"),
    (["stage2.components.conv=false", "stage2.components.conv_width=2"], "stage2.components.conv_width"),
    (["stage2.components.conv_width=8", "stage2.components.conv=false", "stage2.components.gate=false"],
     "stage2.components.conv_width"),
])
def test_a_setting_its_switch_leaves_unused_is_refused_in_one_line(overrides, field):
    """stage2.lora_alpha without LoRA and stage2.components.conv_width without the conv were accepted and did nothing;
    refused as parallel.compile_mode without parallel.compile is: one line naming the field and both fixes."""
    with pytest.raises(ConfigError) as err:
        build_config(overrides=overrides)
    msg = str(err.value)
    assert msg.startswith(field + ":") and "\n" not in msg, msg
    assert ("lora_rank > 0" in msg) if "lora" in field else ("conv=true" in msg), msg
    assert "remove the" in msg, msg


def test_the_same_settings_with_their_switch_on_or_at_their_defaults_are_accepted(tmp_path):
    """With LoRA / the conv on they take effect; at their defaults (what every saved config.yaml holds, whatever the
    switches) they are no setting: a resolved config of a run without LoRA or conv loads again."""
    cfg = build_config(overrides=["stage2.lora_rank=4", "stage2.lora_alpha=8", "stage2.components.conv_width=2"])
    assert cfg.stage2.lora_alpha == 8 and cfg.stage2.components.conv_width == 2
    off = build_config(overrides=["stage2.components.conv=false", "stage2.components.gate=false"])
    again = load_config(save_resolved(off, tmp_path / "run"))
    assert again == off
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["stage2"]["lora_alpha"] == 16.0 and saved["stage2"]["components"]["conv_width"] == 4
    build_config(overrides=["stage2.lora_alpha=16", "stage2.components.conv=false", "stage2.components.conv_width=4"])


def test_hmscale_check_says_it_in_one_line(capsys):
    from hmscale.cli import main

    assert main(["check", "-s", "stage2.lora_alpha=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hmscale: error: stage2.lora_alpha: 8.0") and "\n" not in err, err


# ---------------------------------------------------------------- cache helpers (as tests/teacher/cache/conftest.py)

VOCAB, SEQ_LEN = 300, 32


def _teacher():
    from transformers import GPTNeoXForCausalLM

    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(0)
    cfg = neox_config("pythia-nano", vocab_size=VOCAB)
    cfg._attn_implementation = "eager"
    return GPTNeoXForCausalLM(cfg).eval()


def _data(shards=4, per_shard=3, seed=0):
    from hmscale.data.plan import ShardPlan

    rng = np.random.default_rng(seed)
    n = shards * per_shard * SEQ_LEN
    tokens = rng.integers(1, VOCAB, size=n).astype(np.int32)
    plan = ShardPlan(tokens, np.full(n // 16, 16, dtype=np.int64), SEQ_LEN, per_shard, source=f"random-{seed}")
    return SimpleNamespace(plan=plan, vocab_size=VOCAB, eos_id=0)


def _cache_cfg(root):
    return build_config({}, [f"cache.root={root}", "cache.batch_size=2", "teacher.flavor=pythia-nano"])


def _disk_full_after(m, nbytes: int, failed: list):
    """The shard writer's output fails with ENOSPC once ``nbytes`` are written (``failed[0]`` set then)."""
    from hmscale.teacher.cache.writer import _HashingSink

    out, budget = _HashingSink._out, [nbytes]

    def filling(self, mv):
        budget[0] -= len(mv)
        if budget[0] < 0:
            failed[0] = True
            raise OSError(errno.ENOSPC, "No space left on device")
        return out(self, mv)

    m.setattr(_HashingSink, "_out", filling)


# ---------------------------------------------------------------- 2. the cache's advice names both commands


def test_the_caches_advice_names_the_recipe_that_builds_it_too(tmp_path, monkeypatch):
    """A cache is built by `hmscale cache` or by `hmscale run` (the recipe, before stage 1): its one-line errors and
    its interrupt line said "rerun `hmscale cache`" even to a user whose `hmscale run` was building it."""
    from hmscale.teacher.cache import CacheError, build_cache
    from hmscale.teacher.cache.format import CacheCorruptError, failure_message
    from hmscale.teacher.cache.worker import ShardWorker

    teacher, data = _teacher(), _data()
    with monkeypatch.context() as m:  # a full disk while writing a shard (the real writer, the real message)
        _disk_full_after(m, 100_000, [False])
        with pytest.raises(CacheError) as err:
            build_cache(_cache_cfg(tmp_path / "a"), data, teacher, engine="local", log=lambda *_: None)
    full = str(err.value)
    assert full.startswith("writing shard-") and "No space left on device" in full, full
    assert "`hmscale cache`" in full and "`hmscale run`" in full and "\n" not in full, full

    forward, calls, logs = ShardWorker.forward_batch, [0], []

    def ctrl_c(self, tokens):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return forward(self, tokens)

    with monkeypatch.context() as m:
        m.setattr(ShardWorker, "forward_batch", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            build_cache(_cache_cfg(tmp_path / "b"), data, teacher, engine="local", log=logs.append)
    line = next(x for x in logs if "interrupted:" in x)
    assert "`hmscale cache`" in line and "`hmscale run`" in line, line

    for msg in (str(CacheCorruptError("shard-000001.tar", "the file is missing", tmp_path)),
                failure_message(PermissionError(errno.EACCES, "Permission denied"), "shard-000002.tar", tmp_path)):
        assert "`hmscale cache`" in msg and "`hmscale run`" in msg, msg


# ---------------------------------------------------------------- 3. the manifest's save never hides the shard's error


def test_a_failing_manifest_save_does_not_hide_the_shard_error(tmp_path, monkeypatch):
    """A shard write fails (full disk), and so does the manifest's save after it (the same disk): the user saw the
    manifest's bare OSError (a traceback from `hmscale cache`), not the one line naming the shard. The shard's error
    goes up; the manifest's is logged."""
    from hmscale.teacher.cache import CacheError, build_cache
    from hmscale.teacher.cache.manifest import Manifest

    save, failed, logs = Manifest.save, [False], []

    def save_on_a_full_disk(self):
        if failed[0]:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return save(self)

    with monkeypatch.context() as m:
        _disk_full_after(m, 100_000, failed)
        m.setattr(Manifest, "save", save_on_a_full_disk)
        with pytest.raises(CacheError) as err:
            build_cache(_cache_cfg(tmp_path), _data(), _teacher(), engine="local", log=logs.append)
    assert failed[0]
    assert str(err.value).startswith("writing shard-") and "No space left on device" in str(err.value)
    assert any("manifest could not be saved" in line and "No space left" in line for line in logs), logs


def test_the_manifest_is_still_saved_after_a_shard_failure(tmp_path, monkeypatch):
    """Where it can be saved, the manifest records the shards finished before the failure (the rerun skips them)."""
    from hmscale.teacher.cache import CacheError, build_cache
    from hmscale.teacher.cache.manifest import Manifest

    save, failed, after = Manifest.save, [False], [0]

    def counting(self):
        after[0] += failed[0]
        return save(self)

    with monkeypatch.context() as m:
        _disk_full_after(m, 100_000, failed)
        m.setattr(Manifest, "save", counting)
        with pytest.raises(CacheError):
            build_cache(_cache_cfg(tmp_path), _data(), _teacher(), engine="local", log=lambda *_: None)
    assert after[0] >= 1
    path = next(tmp_path.glob("v1-*"))
    assert {p.name for p in path.glob("shard-*.tar")} == {e["file"] for e in Manifest.load(path).shards.values()}


# ---------------------------------------------------------------- 4. a damaged checkpoint restored by Ray


def _checkpoint(path, step: int, stage: str = "stage2", size: int = 64):
    """A checkpoint directory as Checkpointer.save leaves it, as far as Checkpointer.problem reads it."""
    (path / "state").mkdir(parents=True)
    (path / "state" / "mp_rank_00_model_states.pt").write_bytes(bytes(size))
    meta = {"step": step, "tag": "state", "stage": stage, "files": {"state/mp_rank_00_model_states.pt": size}}
    (path / "meta.json").write_text(json.dumps(meta))
    return meta


def _truncate(ck):
    f = ck / "state" / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:10])


def _damage_lines(capsys) -> list[str]:
    return [x for x in capsys.readouterr().err.splitlines() if "is damaged" in x]


def test_a_damaged_ray_restored_checkpoint_is_passed_over_for_the_run_directorys(tmp_path, capsys):
    """Ray hands exactly one checkpoint (``ray.train.get_checkpoint()``: the latest reported), a copy in Ray's storage
    of one in the run directory. Damaged, it was resumed from and refused (one line: "delete it, a rerun resumes from
    the one before"), while the run directory held that step whole, and a rerun (a new Ray run) never reads Ray's copy.
    It is passed over, as a damaged newest checkpoint of the run directory is: for the same step's original, else the
    one before it, with one line naming it; a whole restore that is further still wins."""
    from ray_jobs.distill import pick_resume_point

    run, ray_dir = tmp_path / "run", tmp_path / "ray" / "checkpoint_000001"
    ckpts = run / "stage2" / "checkpoints"
    _checkpoint(ckpts / "step_00000002", 2)
    _checkpoint(ckpts / "step_00000004", 4)
    meta = _checkpoint(ray_dir, 4)
    assert pick_resume_point(run, ray_dir, meta) == ("stage2", ray_dir)  # whole: Ray's (a tie: as before)
    assert _damage_lines(capsys) == []

    _truncate(ray_dir)
    assert pick_resume_point(run, ray_dir, meta) == ("stage2", ckpts / "step_00000004")
    lines = _damage_lines(capsys)
    assert len(lines) == 1 and str(ray_dir) in lines[0], lines
    assert "state/mp_rank_00_model_states.pt has 10 bytes, 64 when written" in lines[0], lines

    _truncate(ckpts / "step_00000004")  # the run directory's copy damaged too: the one before it
    assert pick_resume_point(run, ray_dir, meta) == ("stage2", ckpts / "step_00000002")
    assert len(_damage_lines(capsys)) == 2

    (ray_dir / "meta.json").write_text("{oops")  # unreadable meta.json (train_func reads it as {}): named too
    assert pick_resume_point(run, ray_dir, {}) == ("stage2", ckpts / "step_00000002")
    assert any(str(ray_dir) in x and "meta.json unreadable" in x for x in _damage_lines(capsys))

    further = tmp_path / "ray" / "checkpoint_000002"  # a whole restore further than the run directory's: resumed
    assert pick_resume_point(run, further, _checkpoint(further, 6)) == ("stage2", further)


def test_a_damaged_restore_with_nothing_whole_left_starts_the_stage_over(tmp_path, capsys):
    from ray_jobs.distill import pick_resume_point

    ray_dir = tmp_path / "ray" / "checkpoint_000001"
    meta = _checkpoint(ray_dir, 4, stage="stage1")
    _truncate(ray_dir)
    assert pick_resume_point(tmp_path / "run", ray_dir, meta) == (None, None)
    assert len(_damage_lines(capsys)) == 1


def test_only_rank_0_names_a_damaged_checkpoint(tmp_path, capsys):
    """train_func passes a silent log on the other ranks (every rank picks the same checkpoint)."""
    from ray_jobs.distill import pick_resume_point

    run, ray_dir = tmp_path / "run", tmp_path / "ray" / "checkpoint_000001"
    _checkpoint(run / "stage1" / "checkpoints" / "step_00000003", 3, stage="stage1")
    meta = _checkpoint(ray_dir, 3, stage="stage1")
    _truncate(ray_dir)
    _truncate(run / "stage1" / "checkpoints" / "step_00000003")
    lines = []
    assert pick_resume_point(run, ray_dir, meta, log=lines.append) == (None, None)
    assert len(lines) == 2 and _damage_lines(capsys) == []


# ---------------------------------------------------------------- 5. the BPE's text budget


def _source(docs):
    from hmscale.data.sources import TextSource

    class Docs(TextSource):
        description = "docs"

        def iter_documents(self, split):
            yield from docs

    return Docs()


def test_the_bpe_training_texts_keep_to_their_budget():
    """One huge document crossing the budget was taken whole (8 MB budget, a 100 MB document: 100 MB); it is cut at
    the budget, at a character (not a byte: multi-byte characters stay whole), the same way every time."""
    big = "é€😀x" * 50_000  # 200 000 characters, 2 to 4 bytes each in UTF-8
    src = _source(["a" * 300, big, "never read"])
    texts = src.training_texts(1_001)
    assert [len(t) for t in texts] == [300, 701] and sum(map(len, texts)) == 1_001
    assert texts[1] == big[:701] and texts[1].encode("utf-8").decode("utf-8") == texts[1]
    assert src.training_texts(1_001) == texts  # deterministic
    assert src.training_texts(300) == ["a" * 300]  # a document that ends at the budget: whole, nothing after it
    assert src.training_texts(0) == []
    assert src.training_texts(None) == ["a" * 300, big, "never read"]  # no budget: every document


def test_the_tokenizer_trained_under_the_new_recipe_gets_a_new_cache_key():
    """The BPE of a source changes where a document crossed the budget (the embedded corpus's train split does:
    8 016 471 characters were read for 8 000 000): a tokenizer cached by the old recipe under the same key would be
    reused on one machine and trained differently on another."""
    from hmscale.data import tokenizer

    src = SimpleNamespace(key=lambda split: "k")
    old = tokenizer.stable_hash({"v": 1, "train": "k", "vocab": 300, "chars": 1000})
    assert tokenizer.bpe_cache_key(src, 300, 1000) != old
