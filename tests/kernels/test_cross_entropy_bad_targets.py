"""Cross-entropy targets outside [0, V) (other than ignore_index): the Triton loss must not read a neighbouring row's
logit (or memory past the logits) and return a finite, wrong loss. ``F.cross_entropy`` raises on such a target
(IndexError on the CPU, a device-side assert on CUDA); the kernel path raises too (``torch._assert_async``: no host
synchronisation on CUDA), and the kernel itself turns such a row's loss and gradient into NaN rather than reading
out of bounds."""

import subprocess
import sys
import textwrap

import pytest
import torch

from kernels import cross_entropy_reference
from kernels.cross_entropy import cross_entropy_sum_triton, next_token_loss_sums

from ._helpers import TRITON_DEVICE, needs_triton, rel

pytestmark = needs_triton


def _logits(rows, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g).to(TRITON_DEVICE)


def _dies_of_a_device_assert(code: str) -> None:
    """On CUDA the check is a device-side assert, which leaves the process's CUDA context unusable (every later test
    of this worker would fail): the call runs in a process of its own, which must stop on the assert."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "assert" in run.stderr.lower(), run.stderr[-2000:]


@pytest.mark.parametrize("bad", [97, 98, 1000, -1, -7])
def test_out_of_range_target_is_an_error_not_a_silent_loss(bad):
    V = 97
    if TRITON_DEVICE == "cuda":
        _dies_of_a_device_assert(f"""
            import torch
            from kernels.cross_entropy import cross_entropy_sum_triton
            z = torch.randn(6, {V}, device="cuda")
            t = torch.tensor([0, 5, {bad}, -100, 2, 96], device="cuda")
            print(float(cross_entropy_sum_triton(z, t)))  # (the host read: where the assert surfaces)
        """)
        return
    z = _logits(6, V)
    t = torch.tensor([0, 5, bad, -100, 2, 96], device=TRITON_DEVICE)
    with pytest.raises(IndexError):  # what the reference does
        cross_entropy_reference(z, t)
    with pytest.raises(RuntimeError, match="target"):
        cross_entropy_sum_triton(z, t)


def test_out_of_range_next_token_id_is_an_error():
    V = 50
    logits = _logits(2 * 5, V, seed=1).reshape(2, 5, V)
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2)).to(TRITON_DEVICE)
    ids[1, 3] = V + 4  # a token id past the model's vocabulary
    if TRITON_DEVICE == "cuda":
        _dies_of_a_device_assert(f"""
            import torch
            from kernels.cross_entropy import next_token_loss_sums
            ids = torch.randint(0, {V}, (2, 5), device="cuda")
            ids[1, 3] = {V + 4}
            ce, _ = next_token_loss_sums(torch.randn(2, 5, {V}, device="cuda"), ids)
            print(float(ce))
        """)
    else:
        with pytest.raises(RuntimeError, match="target"):
            next_token_loss_sums(logits, ids)
    ids[1, 3] = V - 1
    ids[0, 0] = V + 4  # position 0 is never a target: no error
    ce, _ = next_token_loss_sums(logits, ids)
    ref = cross_entropy_reference(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    assert rel(ce, ref) <= 1e-6


def test_kernel_gives_nan_for_an_out_of_range_row_without_the_host_check(monkeypatch):
    """The kernel's own guard (where the asynchronous assert is not reached, e.g. a CUDA run that goes on):
    the bad row's loss and gradient are NaN, the other rows' gradients are untouched."""
    import kernels.cross_entropy as ce_mod

    monkeypatch.setattr(ce_mod, "_check_targets", lambda *a, **k: None)
    V = 97
    z = _logits(5, V, seed=3)
    t = torch.tensor([1, 96, 97, -100, 0], device=TRITON_DEVICE)
    zl = z.clone().requires_grad_()
    loss = ce_mod.cross_entropy_sum_triton(zl, t)
    assert torch.isnan(loss)
    (dz,) = torch.autograd.grad(loss, zl)
    assert torch.isnan(dz[2]).all()
    keep = [0, 1, 4]
    zr = z.clone().requires_grad_()
    ref = cross_entropy_reference(zr, torch.where(t == 97, -100, t))
    (dz_ref,) = torch.autograd.grad(ref, zr)
    assert rel(dz[keep], dz_ref[keep]) <= 1e-5
    assert dz[3].abs().max() == 0
