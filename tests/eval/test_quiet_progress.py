"""HMSCALE_NO_PROGRESS=1 (batch logs) also silences hmscale's lm-eval bar and datasets' bars (README walk,
sixteenth session: both still drew on stderr)."""
import os
import subprocess
import sys

CHECK = """
import datasets
from hmscale.cli import _quiet_hub_progress_bars
before = datasets.is_progress_bar_enabled()
_quiet_hub_progress_bars()
import os
print(before, datasets.is_progress_bar_enabled(), os.environ.get("HF_DATASETS_DISABLE_PROGRESS_BARS"))
"""


def _datasets_bars(no_progress: bool) -> str:
    env = {k: v for k, v in os.environ.items()  # (a fresh process: datasets reads its switch once, on import)
           if k not in ("HMSCALE_NO_PROGRESS", "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS")}
    if no_progress:
        env["HMSCALE_NO_PROGRESS"] = "1"
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.split()


def test_datasets_bars_follow_hmscale_no_progress():
    assert _datasets_bars(False) == ["True", "True", "None"]
    assert _datasets_bars(True) == ["True", "False", "1"]  # (and its workers, which inherit the environment)


def test_the_lm_eval_bar_follows_hmscale_no_progress(monkeypatch):
    from hmscale.eval.lm_eval_adapter import HmscaleLM

    lm = object.__new__(HmscaleLM)  # (_progress reads nothing of the instance but its type)
    monkeypatch.delenv("HMSCALE_NO_PROGRESS", raising=False)
    assert not lm._progress(list(range(5)), False).disable
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    assert lm._progress(list(range(5)), False).disable
