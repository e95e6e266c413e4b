"""Mistaken arguments that crashed with a traceback from inside the checks (or the Triton driver) instead of the
promised one-line ValueError naming the argument, or were silently accepted; found walking the API as a mamba_ssm
user would call it."""

import pytest
import torch

from kernels import ssd, ssd_step
from kernels.compat import mamba_chunk_scan_combined, selective_state_update

b, l, h, g, p, n = 2, 5, 4, 2, 3, 6


def _scan():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(b, l, h, p, generator=gen), torch.rand(b, l, h, generator=gen) + 0.1,
            -torch.rand(h, generator=gen) - 0.1, torch.randn(b, l, g, n, generator=gen),
            torch.randn(b, l, g, n, generator=gen))


def _step():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(b, h, p, n, generator=gen), torch.randn(b, h, p, generator=gen),
            torch.rand(b, h, generator=gen) + 0.1, -torch.rand(h, generator=gen) - 0.1,
            torch.randn(b, g, n, generator=gen), torch.randn(b, g, n, generator=gen))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_zero_groups_is_a_one_line_error_not_a_zero_division(backend):
    """B, C (b, l, 0, n) (a fused projection split at the wrong offsets): ``h % g`` raised ZeroDivisionError."""
    x, dt, A, B, C = _scan()
    with pytest.raises(ValueError, match=r"^ssd: B must be \(b, l, g, n\)"):
        ssd(x, dt, A, B[:, :, :0], C[:, :, :0], backend=backend)
    state, x_t, dt_t, A, B_t, C_t = _step()
    with pytest.raises(ValueError, match=r"^ssd_step: B_t must be \(b, g, n\)"):
        ssd_step(state, x_t, dt_t, A, B_t[:, :0], C_t[:, :0], backend="torch")
    s = state.clone()
    with pytest.raises(ValueError, match=r"^selective_state_update: B must be \(b, g, n\)"):
        selective_state_update(s, x_t, dt_t[..., None].expand(b, h, p), A[:, None, None].expand(h, p, n),
                               B_t[:, :0], C_t[:, :0])
    assert torch.equal(s, state)


def test_a_non_tensor_x_is_named_by_the_step_checks():
    """ssd_step / selective_state_update with x a list: ``'list' object has no attribute 'device'`` (the other
    tensors' devices were compared with x's before x itself was checked)."""
    state, x_t, dt_t, A, B_t, C_t = _step()
    with pytest.raises(ValueError, match=r"^ssd_step: x_t must be a tensor, got list"):
        ssd_step(state, x_t.tolist(), dt_t, A, B_t, C_t)
    dt3, A3 = dt_t[..., None].expand(b, h, p), A[:, None, None].expand(h, p, n)
    with pytest.raises(ValueError, match=r"^selective_state_update: x must be a tensor, got list"):
        selective_state_update(state, x_t.tolist(), dt3, A3, B_t, C_t)
    with pytest.raises(ValueError, match=r"^selective_state_update: state must be a tensor, got list"):
        selective_state_update(state.tolist(), x_t, dt3, A3, B_t, C_t)
    with pytest.raises(ValueError, match=r"^selective_state_update: dt must be a tensor, got list"):
        selective_state_update(state[:, 0], x_t[:, 0], dt3[:, 0].tolist(), A3[0], B_t[:, 0], C_t[:, 0])


def test_selective_state_update_b_and_c_of_different_groups_are_refused_on_both_paths():
    """mamba_ssm requires C.shape == B.shape; the per-channel (PyTorch) path silently computed with B of 2 groups
    and C of 1, the tied path refused it under another function's name (``ssd_step: B_t and C_t ...``)."""
    state, x_t, dt_t, A, B_t, C_t = _step()
    C1 = C_t[:, :1]
    per_channel = (torch.rand(b, h, p) + 0.1, -torch.rand(h, p, n) - 0.1)
    tied = (dt_t[..., None].expand(b, h, p), A[:, None, None].expand(h, p, n))
    for dt3, A3 in (per_channel, tied):
        s = state.clone()
        with pytest.raises(ValueError, match=r"^selective_state_update: B and C must have one shape \(b, g, n\)"):
            selective_state_update(s, x_t, dt3, A3, B_t, C1)
        assert torch.equal(s, state)


@pytest.mark.parametrize("kwargs,match", [
    (dict(z=[1.0]), r"z must have x's shape \(2, 5, 4, 3\), got list"),
    (dict(z=torch.zeros(2, 1, 4, 3)), r"z must have x's shape \(2, 5, 4, 3\), got \(2, 1, 4, 3\)"),
    (dict(dt_bias=torch.zeros(3)), r"dt_bias must be \(h,\) = \(4,\), got \(3,\)"),
    (dict(cu_seqlens=[0, 5], return_varlen_states=True), r"cu_seqlens must be an integer tensor"),
    (dict(return_varlen_states=True), r"return_varlen_states needs cu_seqlens"),
])
def test_compat_scan_errors_are_one_line_and_name_the_function(kwargs, match):
    """A list z (or cu_seqlens) raised AttributeError; z's and dt_bias's shape errors and the varlen ones did not say
    which function refused them, as every other error of the module does."""
    x, dt, A, B, C = _scan()
    if kwargs.get("return_varlen_states"):  # batch 1, as mamba_ssm's varlen states
        x, dt, B, C = x[:1], dt[:1], B[:1], C[:1]
    with pytest.raises(ValueError, match="^mamba_chunk_scan_combined: " + match):
        mamba_chunk_scan_combined(x, dt, A, B, C, 64, backend="torch", **kwargs)


def test_triton_step_on_cpu_without_the_interpreter_is_one_line(monkeypatch):
    """backend='triton' on CPU tensors without TRITON_INTERPRET=1: the scan says what to do, the step failed inside
    Triton's driver ('0 active drivers ([]). There should only be one.', or a pointer error on a GPU machine)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    state, x_t, dt_t, A, B_t, C_t = _step()
    with pytest.raises(RuntimeError, match=r"^the Triton SSD needs CUDA tensors .*use backend='torch' on CPU"):
        ssd_step(state, x_t, dt_t, A, B_t, C_t, backend="triton")
