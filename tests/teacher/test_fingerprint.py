"""teacher_fingerprint: deterministic, and changed by any weight or config change."""

import torch
from transformers import GPTNeoXForCausalLM

from hmscale.teacher.fingerprint import teacher_fingerprint
from hmscale.teacher.flavors import neox_config


def _model(seed=0, **over):
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(neox_config("pythia-nano", 64, **over))


def test_fingerprint(tmp_path):
    a, b = _model(), _model()
    fa = teacher_fingerprint(a)
    assert len(fa) == 64 and fa == teacher_fingerprint(b)
    with torch.no_grad():
        b.gpt_neox.layers[1].attention.dense.weight[3, 5] += 1e-6
    assert teacher_fingerprint(b) != fa
    assert teacher_fingerprint(_model(seed=1)) != fa
    assert teacher_fingerprint(_model(rotary_pct=1.0)) != fa  # same weight shapes, other config
    # a save/load round trip keeps it (where it was saved does not matter); a dtype change does not
    a.save_pretrained(tmp_path / "m")
    loaded = GPTNeoXForCausalLM.from_pretrained(tmp_path / "m")
    assert teacher_fingerprint(loaded) == fa
    assert teacher_fingerprint(loaded.to(torch.bfloat16)) != fa
