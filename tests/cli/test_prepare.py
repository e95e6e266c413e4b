"""`hmscale prepare`: the data alone (tokenizer, stream, plan), cached, with the budget coverage said in one line."""

import json

from hmscale.cli import main


def _args(tmp_path, *extra):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " + "state space model " * (20 + i % 7)}) + "\n"
                            for i in range(300)))
    return ["prepare", "-s", "data.source=files", "-s", f"data.paths=[{docs}]", "-s", "data.seq_len=32",
            "-s", "data.sequences_per_shard=4", "-s", "tokenizer.vocab_size=300", "-s", f"data.cache_dir={tmp_path}/c",
            *extra]


def test_prepare_reports_the_plan_and_the_budget_coverage(tmp_path, capsys):
    assert main(_args(tmp_path, "-s", "budget.total_tokens=1000")) == 0
    out = capsys.readouterr().out
    assert "train tokens in plan" in out and "covers budget.total_tokens=1,000" in out
    assert main(_args(tmp_path, "-s", "budget.total_tokens=100000000")) == 0  # the same stream, reused
    out = capsys.readouterr().out
    assert "cached stream" in out and "the stages will revisit rows" in out


def test_prepare_bad_path_is_one_line(tmp_path, capsys):
    args = _args(tmp_path)
    args[args.index(f"data.paths=[{tmp_path / 'docs.jsonl'}]")] = f"data.paths=[{tmp_path}/missing.jsonl]"
    assert main(args) == 2
    assert "data.paths" in capsys.readouterr().err
