"""A config that `hmscale run` refuses before any work (stage 1 cannot train from the cache it captures) passed
`hmscale check` without a word, and `hmscale submit` uploaded it and started a job that failed on the cluster: found
auditing the README's Commands ("hmscale check: validate a config")."""

from typer.testing import CliRunner

from hmscale.cli import app

NO_ATTN_INPUT = ["-s", "cache.capture.tensors=[attn_output]"]


def _run(args):
    return CliRunner().invoke(app, args)


def test_check_names_what_would_stop_stage_1_and_still_prints_the_tree():
    res = _run(["check", *NO_ATTN_INPUT])
    assert res.exit_code == 0  # (a cache-only config is a valid config: `hmscale cache` and `stage2` take it)
    assert "tensors:" in res.stdout and "attn_output" in res.stdout
    note = [line for line in res.stderr.splitlines() if "cache.capture.tensors" in line]
    assert len(note) == 1 and "hmscale run" in note[0] and "stage1.source=online" in note[0]
    assert "cache.capture.tensors" not in _run(["check"]).stderr


def test_submit_refuses_it_before_reaching_the_cluster():
    # an address where nothing listens: the refusal comes first, from the config alone
    res = _run(["submit", "--address", "http://127.0.0.1:9", *NO_ATTN_INPUT])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hmscale: error: cache.capture.tensors:"), res.stderr
    assert "job API" not in res.stderr and "stage1.source=online" in res.stderr
