"""HMSCALE_NO_PROGRESS=1 (batch logs) also silences hmscale's lm-eval bar and datasets' bars (README walk,
sixteenth session: both still drew on stderr)."""
import os

import pytest


@pytest.fixture
def bars_restored():
    import datasets

    before = {k: os.environ.get(k) for k in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    yield
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    datasets.enable_progress_bars()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_the_lm_eval_bar_and_datasets_bars_follow_hmscale_no_progress(monkeypatch, bars_restored):
    import datasets

    from hmscale.cli import _quiet_hub_progress_bars
    from hmscale.eval.lm_eval_adapter import HmscaleLM

    lm = object.__new__(HmscaleLM)  # (_progress reads nothing of the instance but its type)
    monkeypatch.delenv("HMSCALE_NO_PROGRESS", raising=False)
    datasets.enable_progress_bars()  # (another test's run in this process may have turned them off)
    assert not lm._progress(list(range(5)), False).disable
    _quiet_hub_progress_bars()
    assert datasets.is_progress_bar_enabled()
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    assert lm._progress(list(range(5)), False).disable
    _quiet_hub_progress_bars()
    assert not datasets.is_progress_bar_enabled()
    assert os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"
