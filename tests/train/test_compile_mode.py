"""parallel.compile_mode: torch.compile's mode for the stage-2 student's blocks (reduce-overhead replays each
block's graphs as CUDA graphs).

CPU: the config's checks and the mode reaching apply_compile. GPU: stage 2 with reduce-overhead gives the
default compile's losses step for step (fp32, ZeRO 0, 1 and 2, gradient accumulation 2, validation in between;
ZeRO 0/1 accumulate param.grad, which keep_gradients_out_of_graph_pool keeps out of the graphs' pool).
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hmscale.config import build_config


@pytest.mark.parametrize("overrides, message", [
    (["parallel.compile_mode=reduce-overhead"], "needs parallel.compile=true"),
    (["parallel.compile=true", "parallel.compile_mode=reduce-overhead"], "use_gpu=true"),
    (["parallel.compile=true", "parallel.compile_mode=reduce-overhead", "parallel.use_gpu=true",
      "parallel.zero_stage=3"], "zero_stage<=2"),
    (["parallel.compile=true", "parallel.compile_mode=reduce-overhead", "parallel.use_gpu=true",
      "parallel.num_workers=2", "parallel.tp=2"], "tp=1"),
    (["parallel.compile=true", "parallel.compile_mode=fast"], "compile_mode"),
])
def test_bad_compile_mode_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_config({}, overrides)


def test_accepted_compile_modes():
    cfg = build_config({}, ["parallel.compile=true", "parallel.compile_mode=reduce-overhead", "parallel.use_gpu=true"])
    assert cfg.parallel.compile_mode == "reduce-overhead"
    cfg = build_config({}, ["parallel.compile=true", "parallel.compile_mode=max-autotune-no-cudagraphs"])
    assert cfg.parallel.compile_mode == "max-autotune-no-cudagraphs"


def _stage2(tmp_path, name, overrides):
    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config
    from hmscale.train.data import ArraySource
    from hmscale.train.stage2 import run_stage2
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(0)
    teacher = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=96)).eval()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 96, size=(32, 32))
    data = SimpleNamespace(val_tokens=rng.integers(0, 96, size=(4, 32)))
    cfg = build_config({}, ["stage2.steps=4", "stage2.micro_batch_size=2", "stage2.grad_accum=2", "stage2.eval_every=2",
                            "stage2.warmup_steps=1", "eval.max_sequences=4", *overrides])
    return run_stage2(cfg, tmp_path / name, data=data, student=to_hedgehog(teacher), source=ArraySource(tokens),
                      export=False)


def test_stage2_passes_the_mode_to_apply_compile(tmp_path, monkeypatch):
    """(recorded, not compiled: compiling on CPU takes a minute)"""
    import hmscale.parallel as hp

    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    seen = []
    monkeypatch.setattr(hp, "apply_compile", lambda model, mode=None: seen.append(mode) or 0)
    for mode, expect in (("default", None), ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs")):
        _stage2(tmp_path, mode, ["stage2.steps=1", "parallel.zero_stage=1", "parallel.compile=true",
                                 f"parallel.compile_mode={mode}"])
        assert seen[-1] == expect


def test_gradient_copies_leave_the_gradients_unchanged():
    from hmscale.parallel import keep_gradients_out_of_graph_pool

    torch.manual_seed(0)
    ref, model = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    model.load_state_dict(ref.state_dict())
    model.bias.requires_grad_(False)
    assert keep_gradients_out_of_graph_pool(model) == 1  # trainable parameters only
    ref.bias.requires_grad_(False)
    x = torch.randn(4, 5)
    for _ in range(2):  # two micro-batches accumulate
        for m in (ref, model):
            (m(x) ** 2).sum().backward()
    torch.testing.assert_close(model.weight.grad, ref.weight.grad, rtol=0, atol=0)
    assert model.weight.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_reduce_overhead_matches_the_default_compile(tmp_path, monkeypatch, zero):
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    torch.backends.cuda.matmul.allow_tf32 = False
    common = ["parallel.use_gpu=true", "parallel.compile=true", f"parallel.zero_stage={zero}"]
    runs = {mode: _stage2(tmp_path, mode, common + [f"parallel.compile_mode={mode}"])
            for mode in ("default", "reduce-overhead")}
    ref, got = runs["default"], runs["reduce-overhead"]
    assert len(got["losses"]) == len(ref["losses"]) == 4
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
    assert ref["losses"][-1] != ref["losses"][0]  # the optimizer moved the weights: a real comparison
