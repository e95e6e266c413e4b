"""A cache shorter than stage 1's token share (`cache.max_tokens` below `budget.stage1_tokens`): a cached stage 1 draws
its rows from the shards the cache holds, fewer than the share an online stage 1 reads, and revisits them; the README
promises that online and cached stage 1 read the same rows. It did so without a word; now `hmscale check` and the
start of stage 1 say it in one line: tokens read, tokens held, passes, and what to set."""

import pytest
from typer.testing import CliRunner

from hmscale.cli import app

SHORT = ["-s", "cache.max_tokens=16384"]  # one 16,384-token shard (64 rows x 256) of stage 1's three


def _notes(res):
    return [line for line in res.stderr.splitlines() if "cache.max_tokens" in line]


def test_check_says_a_short_cache_reads_other_rows_in_one_line():
    res = CliRunner().invoke(app, ["check", *SHORT])
    assert res.exit_code == 0 and "max_tokens: 16384" in res.stdout  # (a valid config: a note, not a refusal)
    notes = _notes(res)
    assert len(notes) == 1, res.stderr
    note = notes[0]
    # default budget: stage 1's share is 40,000 tokens (3 shards); 19 steps of 8 rows of 256 tokens read 38,912
    assert note.startswith("hmscale: note: stage 1 reads 38,912 tokens from a teacher cache holding 16,384 for it "), note
    assert "2.4 passes" in note and "other rows than an online stage 1" in note
    assert "cache.max_tokens to at least 40,000, or unset it" in note


@pytest.mark.parametrize("over", [[], ["-s", "cache.max_tokens=40000"], ["-s", "stage1.source=online", *SHORT],
                                  ["-s", "cache.enabled=false", "-s", "stage1.source=online", *SHORT]])
def test_no_note_when_stage_1_reads_its_whole_share(over):
    res = CliRunner().invoke(app, ["check", *over])
    assert res.exit_code == 0 and not _notes(res), res.stderr


def test_the_note_counts_stage_1_steps_and_workers():
    from hmscale.config import build_config
    from hmscale.train.stage1 import short_cache_note

    cfg = build_config({}, ["cache.max_tokens=16384", "stage1.steps=4", "parallel.num_workers=2"])
    note = short_cache_note(cfg)
    assert note.startswith("stage 1 reads 16,384 tokens from a teacher cache holding 16,384 for it "), note  # 4 x 2 x 8 x 256
    assert "1.0 passes" in note
    few = short_cache_note(build_config({}, ["cache.max_tokens=16384", "stage1.steps=2"]))
    assert "0.25 passes" in few and "other rows than an online stage 1" in few  # fewer tokens, still other rows
    assert short_cache_note(build_config({}, ["cache.max_tokens=16384", "budget.split=[0.0, 1.0]"])) is None


def test_stage_1_from_a_short_cache_says_so_at_its_start(tmp_path, capsys, monkeypatch):
    """The run's own line, from its cache and data plan: and the rows do differ from an online stage 1's."""
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    from tests.train.test_stage1_modes import common, data_of, teacher_of

    from hmscale.config import build_config
    from hmscale.teacher.cache import open_for_run
    from hmscale.teacher.cache.build import build_cache, plan_meta, stage_shard_ids
    from hmscale.train.stage1 import run_stage1

    teacher, data = teacher_of(), data_of()  # stage 1's share: 192 tokens = shards 0 and 1 (96 tokens each)
    cfg = build_config({}, common(tmp_path / "cache") + ["cache.max_tokens=96"])
    cache = build_cache(cfg, data, teacher, log=lambda *_: None)
    assert open_for_run(cfg, cache, stage="stage1").shard_ids == [0] != stage_shard_ids(cfg, plan_meta(data.plan),
                                                                                          "stage1")
    capsys.readouterr()
    run_stage1(cfg, tmp_path / "run", teacher=teacher, data=data, cache_dir=cache, export=False)
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "cache.max_tokens" in line]
    assert len(notes) == 1, out
    assert notes[0].startswith("stage1: note: stage 1 reads 192 tokens from a teacher cache holding 96 for it "), notes
    assert "2.0 passes" in notes[0] and "cache.max_tokens to at least 192" in notes[0]

    capsys.readouterr()  # the whole share cached: not a word
    full = build_config({}, common(tmp_path / "cache"))
    run_stage1(full, tmp_path / "run-full", teacher=teacher, data=data,
               cache_dir=build_cache(full, data, teacher, log=lambda *_: None), export=False)
    assert "cache.max_tokens" not in capsys.readouterr().out
