"""parallel.compile routes the stage-2 student through hmscale.parallel.apply_compile.

Here, not in tests/parallel: a DeepSpeed run inside the pytest process must not precede the fork-based
2-process tests there.
"""

import torch


def test_stage2_compiles_the_student_when_asked(tmp_path, monkeypatch):
    """parallel.compile=true routes the stage-2 student through apply_compile (recorded, not compiled, for speed)."""
    import numpy as np

    import hmscale.parallel as hp
    from hmscale.config import build_config
    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config
    from hmscale.train.data import ArraySource
    from hmscale.train.stage2 import run_stage2
    from transformers import GPTNeoXForCausalLM

    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    seen = []
    monkeypatch.setattr(hp, "apply_compile", lambda model, **kw: seen.append(type(model).__name__) or 0)
    torch.manual_seed(0)
    teacher = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=96)).eval()
    tokens = np.random.default_rng(0).integers(0, 96, size=(16, 32))
    for flag, expect in (("false", []), ("true", ["HedgeMambaForCausalLM"])):
        seen.clear()
        cfg = build_config({}, ["stage2.steps=1", "stage2.micro_batch_size=4", "parallel.zero_stage=1",
                                f"parallel.compile={flag}"])
        run_stage2(cfg, tmp_path / flag, student=to_hedgehog(teacher), source=ArraySource(tokens), export=False)
        assert seen == expect
