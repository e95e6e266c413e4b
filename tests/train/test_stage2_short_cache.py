"""A cache shorter than the budget (`cache.max_tokens` below `budget.total_tokens`) under stage 2 with cached KD
(`cache.capture.topk > 0`, `stage2.kd_weight > 0`, `stage2.kd_source=cache`): stage 2 then draws its rows from the
shards the cache holds, fewer than the budget's shards a stage 2 without KD (or with online KD) reads, and revisits
them; the README promises that stage 2 with or without cached KD reads the same rows (a KD ablation changes the loss,
not the data). It did so without a word; now `hmscale check` and the start of stage 2 say it in one line, as they do
for stage 1 (tests/train/test_stage1_short_cache.py)."""

import pytest
from typer.testing import CliRunner

from hmscale.cli import app

KD = ["-s", "cache.capture.topk=32", "-s", "stage2.kd_weight=0.5"]
# four 16,384-token shards (64 rows x 256): stage 1's 40,000-token share (3 shards) whole, stage 2's 25 not
SHORT = ["-s", "cache.max_tokens=65536"]


def _notes(res):
    return [line for line in res.stderr.splitlines() if "cache.max_tokens" in line]


def _overrides_of(root, *extra):
    """The miniature run of tests/train/test_stage1_modes.py with top-k cached, stage 2 without KD."""
    from tests.train.test_stage1_modes import common

    return common(root) + ["cache.capture.topk=4", "stage2.steps=2", "stage2.micro_batch_size=2",
                           "stage2.warmup_steps=1", *extra]


def _walk_kd(root, *extra):
    from hmscale.config import build_config

    return build_config({}, _overrides_of(root, "stage2.kd_weight=0.5", *extra))


def test_a_cached_kd_stage_2_reads_fewer_shards_than_one_without_kd(tmp_path):
    """The gap itself: the shards (and rows) stage 2 reads with cached KD from a short cache vs without KD."""
    from tests.train.test_stage1_modes import data_of, teacher_of

    from hmscale.config import build_config
    from hmscale.teacher.cache.build import build_cache, plan_meta, stage_shard_ids
    from hmscale.train.stage2 import _source_for

    teacher, data = teacher_of(), data_of()  # stage 2 draws from every shard of the 4-shard plan (1,920 tokens)
    kd = _walk_kd(tmp_path / "cache", "cache.max_tokens=96")  # one 96-token shard
    cache = build_cache(kd, data, teacher, log=lambda *_: None)
    with_kd = _source_for(kd, data, cache)
    without = _source_for(build_config({}, _overrides_of(tmp_path / "cache", "cache.max_tokens=96")), data, None)
    assert stage_shard_ids(kd, plan_meta(data.plan), "stage2") == [0, 1, 2, 3]
    assert with_kd.reader.shard_ids == [0]  # the cache's one shard: 3 rows, not the 12 stage 2 reads without KD
    assert (with_kd.num_sequences, without.num_sequences) == (3, 12)


def test_check_says_a_short_cache_under_cached_kd_reads_other_rows_in_one_line():
    res = CliRunner().invoke(app, ["check", *KD, *SHORT])
    assert res.exit_code == 0 and "max_tokens: 65536" in res.stdout  # (a valid config: a note, not a refusal)
    notes = _notes(res)
    assert len(notes) == 1, res.stderr  # (stage 1's share, 3 shards, is held whole: no stage-1 line)
    note = notes[0]
    # default budget: 400,000 tokens (25 shards); stage 2's 175 steps of 8 rows of 256 tokens read 358,400
    assert note.startswith("hmscale: note: stage 2 reads 358,400 tokens from a teacher cache holding 65,536 for it "
                           "(cache.max_tokens=65,536: 4 of the 25 shards "), note
    assert "5.5 passes" in note and "other rows than a stage 2 without cached KD" in note
    assert "cache.max_tokens to at least 400,000, or unset it" in note


def test_check_says_it_for_each_stage_a_short_cache_shortens():
    res = CliRunner().invoke(app, ["check", *KD, "-s", "cache.max_tokens=16384"])
    assert res.exit_code == 0
    notes = _notes(res)
    assert len(notes) == 2, res.stderr
    assert notes[0].startswith("hmscale: note: stage 1 reads 38,912 tokens ") and "2.4 passes" in notes[0]
    assert notes[1].startswith("hmscale: note: stage 2 reads 358,400 tokens from a teacher cache holding 16,384 ")
    assert "21.9 passes" in notes[1]


@pytest.mark.parametrize("over", [
    KD,  # no cache.max_tokens: the whole budget is cached
    [*KD, "-s", "cache.max_tokens=400000"],
    [*KD, *SHORT, "-s", "stage2.kd_source=online"],  # online KD reads the data plan's rows
    ["-s", "cache.capture.topk=32", *SHORT],  # no KD: stage 2 reads the data plan's rows
    [*KD, *SHORT, "-s", "budget.split=[1.0, 0.0]"],  # stage 2 trains no step (stage 1, the whole budget, has a line)
])
def test_no_note_when_stage_2_reads_the_budgets_rows(over):
    res = CliRunner().invoke(app, ["check", *over])
    assert res.exit_code == 0 and not [n for n in _notes(res) if "stage 2" in n], res.stderr


def test_the_note_counts_stage_2_steps_accumulation_and_workers():
    from hmscale.config import build_config
    from hmscale.train.common import short_cache_note

    base = ["cache.capture.topk=32", "stage2.kd_weight=0.5", "cache.max_tokens=65536"]
    cfg = build_config({}, base + ["stage2.steps=4", "stage2.grad_accum=2", "parallel.num_workers=2"])
    note = short_cache_note(cfg, stage="stage2")  # 4 steps x 2 workers x 2 micro-batches x 8 rows x 256
    assert note.startswith("stage 2 reads 32,768 tokens from a teacher cache holding 65,536 for it "), note
    assert "0.50 passes" in note and "other rows than a stage 2 without cached KD" in note
    assert short_cache_note(cfg) is None  # stage 1's share is held whole
    with pytest.raises(ValueError, match="stage"):
        short_cache_note(cfg, stage="stage3")


def test_stage_2_from_a_short_cache_says_so_at_its_start(tmp_path, capsys, monkeypatch):
    """The run's own line, from its cache's data plan and its steps; not a word with the whole budget cached."""
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    from tests.train.test_stage1_modes import data_of, teacher_of

    from hmscale.teacher.cache.build import build_cache
    from hmscale.train.stage2 import run_stage2

    teacher, data = teacher_of(), data_of()
    cfg = _walk_kd(tmp_path / "cache", "cache.max_tokens=96")
    cache = build_cache(cfg, data, teacher, log=lambda *_: None)
    capsys.readouterr()
    run_stage2(cfg, tmp_path / "run", model=teacher_of(seed=1), data=data, cache_dir=cache, export=False)
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "cache.max_tokens" in line]
    assert len(notes) == 1, out
    # 2 steps x 2 rows x 32 tokens = 128 tokens from the cache's one 96-token shard, of the plan's 4
    assert notes[0].startswith("stage2: note: stage 2 reads 128 tokens from a teacher cache holding 96 for it "
                               "(cache.max_tokens=96: 1 of the 4 shards "), notes
    assert "1.3 passes" in notes[0] and "cache.max_tokens to at least 1,920" in notes[0]

    full = _walk_kd(tmp_path / "cache")  # the whole budget cached: not a word
    capsys.readouterr()
    run_stage2(full, tmp_path / "run-full", model=teacher_of(seed=1), data=data,
               cache_dir=build_cache(full, data, teacher, log=lambda *_: None), export=False)
    assert "cache.max_tokens" not in capsys.readouterr().out
