"""The same checks on a CUDA device, where the models run the Triton SSD kernels (skipped on CPU).

Run on the GPU machine with the compiled kernels: `TRITON_INTERPRET=0 python -m pytest tests/models/test_gpu.py`
(tests/conftest.py defaults TRITON_INTERPRET to 1). Passed on one H200 (torch 2.11, Triton 3.6, transformers 5.17), 2026-11-29.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _models(rotary_pct=0.25, parallel=True, heads=4):
    from test_exact_init import make_teacher, randomise_feature_maps

    from hmscale.models.convert import to_hedgehog, to_hedgemamba

    teacher = make_teacher(rotary_pct, parallel, heads).cuda()
    student = to_hedgehog(teacher)
    randomise_feature_maps(student)
    return student, to_hedgemamba(student).eval()


@pytest.mark.parametrize("rotary_pct,parallel,heads", [(0.25, True, 4), (1.0, False, 8)])
def test_exact_init_on_gpu(rotary_pct, parallel, heads):
    from hmscale.models.convert import compare_logits

    student, model = _models(rotary_pct, parallel, heads)
    ids = torch.randint(0, 97, (2, 200), device="cuda")
    assert compare_logits(student, model, ids)["max_rel"] <= 1e-4


def test_generate_on_gpu_matches_recompute():
    from test_hedgemamba import make_model

    model = make_model().cuda()
    prompt = torch.randint(1, 97, (2, 70), device="cuda")
    out = model.generate(prompt, max_new_tokens=64, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        full = model(out.sequences[:, :-1]).logits[:, 69:]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-3, atol=1e-3)
    assert torch.equal(full.argmax(-1), out.sequences[:, 70:])


def test_bf16_train_step_on_gpu():
    from test_hedgemamba import make_model

    model = make_model().cuda().to(torch.bfloat16).train()
    ids = torch.randint(1, 97, (4, 256), device="cuda")
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
