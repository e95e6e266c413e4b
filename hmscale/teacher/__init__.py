"""Teacher: loading (hub id or path), quick pretraining of miniatures, per-layer capture, fingerprint.

`get_teacher(cfg, data)` returns a frozen `GPTNeoXForCausalLM` in eval mode: the model at
`cfg.teacher.name_or_path` when set, else the miniature `cfg.teacher.flavor` pretrained on the
data plan's train rows and stored under `{data.cache_dir}/teachers/{key}` (key: the teacher config
section, the plan hash, the vocabulary and the seed), so a rerun reuses it.
"""

from __future__ import annotations

import json
from pathlib import Path

from hmscale.data.cachedir import resumable_dir, stable_hash

__all__ = ["get_teacher", "load_teacher", "teacher_cache_dir"]


def __getattr__(name):
    # the loader (models, transformers: seconds of imports) on first use: the config imports this package's flavors,
    # and with them every command, `hmscale --help` included
    if name == "load_teacher":
        from hmscale.teacher.load import load_teacher

        return load_teacher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def teacher_cache_dir(cfg, data) -> Path:
    section = cfg.teacher.model_dump(mode="json")
    section.pop("dtype", None)  # stored in fp32; the dtype is applied on load
    key = stable_hash({"teacher": section, "plan": data.plan.hash, "vocab": data.vocab_size, "seed": cfg.seed})
    return Path(cfg.data.cache_dir) / "teachers" / f"{cfg.teacher.flavor}-{key}"


def get_teacher(cfg, data, device=None, log=print):
    """The run's teacher, frozen and in eval mode (see the module docstring)."""
    from hmscale.teacher.load import load_teacher

    t = cfg.teacher
    if device is None:
        device = "cuda" if cfg.parallel.use_gpu else "cpu"
    if t.name_or_path:
        model = load_teacher(t.name_or_path, t.dtype, device)
        if model.config.vocab_size < data.vocab_size:
            raise ValueError(f"tokenizer.name_or_path: the tokenizer has {data.vocab_size} tokens but the teacher only "
                             f"{model.config.vocab_size}; use the teacher's own tokenizer")
        topk = cfg.cache.capture.topk
        if topk > model.config.vocab_size:  # (config.py checks published Pythias only: a local config is read here)
            raise ValueError(f"cache.capture.topk: {topk} exceeds the teacher's {model.config.vocab_size}-token "
                             f"vocabulary; set cache.capture.topk<={model.config.vocab_size} (e.g. 32)")
        model.hmscale_info = {"source": t.name_or_path}
        log(f"[teacher] loaded {t.name_or_path} ({t.dtype})")
        trained = getattr(model.config, "max_position_embeddings", None)
        if trained and cfg.data.seq_len > trained:  # (rotary: it runs, but what it teaches past there is extrapolated)
            log(f"[teacher] note: data.seq_len {cfg.data.seq_len} exceeds the {trained} positions the teacher was made "
                f"for (max_position_embeddings); its outputs past position {trained} are extrapolation the students "
                f"learn from; set data.seq_len<={trained} to distill within them")
        return model

    target = teacher_cache_dir(cfg, data)
    if (target / "config.json").exists():
        stats = _read_stats(target)
        ppl = f"; validation perplexity {stats['val_ppl']:.2f} vs unigram {stats['unigram_ppl']:.2f}" if "val_ppl" in stats else ""
        log(f"[teacher] reusing the pretrained {t.flavor} at {target}{ppl}")
    else:
        from hmscale.teacher.pretrain import pretrain_teacher

        built = []

        def build(tmp: Path):
            built.append(tmp)
            model, stats = pretrain_teacher(
                t.flavor, data.vocab_size, data.plan.all_tokens(), steps=t.pretrain_steps, seconds=t.pretrain_seconds,
                lr=t.pretrain_lr, batch_size=t.pretrain_batch_size, seed=cfg.seed, val_tokens=data.val_tokens, log=log,
                device=device,
            )
            model.save_pretrained(tmp)
            if hasattr(data.tokenizer, "save_pretrained"):  # self-contained: usable as teacher.name_or_path
                data.tokenizer.save_pretrained(tmp)
            stats["plan_hash"] = data.plan.hash
            (tmp / "pretrain_stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")

        # one process pretrains, the others (concurrent runs of the same teacher and data) wait and reuse its teacher
        # (the lock file apart, under {data.cache_dir}/locks: teachers/ holds teachers only)
        resumable_dir(target, build, log=log, resume=False, tag="teacher",
                      lock_path=target.parent.parent / "locks" / f"teacher-{target.name}.lock")
        stats = _read_stats(target)
        log(f"[teacher] stored at {target}" if built else f"[teacher] reusing the {t.flavor} another process pretrained at {target}")
    model = load_teacher(target, t.dtype, device)
    model.hmscale_info = {"source": str(target), "pretrain": stats}
    return model


def _read_stats(path: Path) -> dict:
    f = path / "pretrain_stats.json"
    return json.loads(f.read_text()) if f.exists() else {}
