"""A hub teacher whose heads the configured tp does not divide: the config cannot see its shape (no local
config.json, not a registered flavour), so the check waited for stage 2's workers, after stage 1 had trained, and
its ValueError was retried by Ray Train ``parallel.max_failures`` times. Now the driver checks it as soon as the
teacher is loaded (before the cache and any training), and a worker that meets such a refusal stops as on any
deterministic failure (a ConfigError is recorded, not retried)."""

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from hmscale.config import ConfigError, build_config


def _teacher(heads: int):
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=12 * heads, num_hidden_layers=1,
                                            num_attention_heads=heads, intermediate_size=48 * heads))


def _prepare(monkeypatch, heads: int, stages):
    import hmscale.data
    import hmscale.teacher
    import hmscale.teacher.cache
    from ray_jobs import distill

    cfg = build_config({"teacher": {"name_or_path": "some-org/neox-odd-heads"}, "tokenizer": {"name_or_path": "gpt2"},
                        "parallel": {"engine": "local", "num_workers": 2, "tp": 2}})
    monkeypatch.setattr(hmscale.data, "prepare_data", lambda cfg, log=print: object())
    monkeypatch.setattr(hmscale.teacher, "get_teacher", lambda cfg, data, log=print: _teacher(heads))

    def cache_reached(*a, **k):
        raise RuntimeError("the cache build was reached")

    monkeypatch.setattr(hmscale.teacher.cache, "build_cache", cache_reached)
    return distill.prepare(cfg, log=lambda *a, **k: None, stages=stages)


def test_the_driver_refuses_tp_that_does_not_divide_a_hub_teachers_heads(monkeypatch):
    with pytest.raises(ConfigError, match=r"parallel.tp: 2 does not divide the model's 3 attention heads"):
        _prepare(monkeypatch, heads=3, stages=("stage1", "stage2"))
    # heads tp divides: the check passes and preparation goes on (to the cache, here stubbed)
    with pytest.raises(RuntimeError, match="cache build was reached"):
        _prepare(monkeypatch, heads=4, stages=("stage1", "stage2"))
    # stage 1 alone runs without tp's sharding: not refused
    with pytest.raises(RuntimeError, match="cache build was reached"):
        _prepare(monkeypatch, heads=3, stages=("stage1",))


def test_a_workers_tp_refusal_is_a_config_error():
    """What the workers raise (and record instead of retrying) is a ConfigError, still a ValueError for callers."""
    from hmscale.parallel import check_tp_divides

    with pytest.raises(ConfigError, match="MLP width 6"):
        check_tp_divides(4, 4, 6)
    assert issubclass(ConfigError, ValueError)
