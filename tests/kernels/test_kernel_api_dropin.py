"""The public kernel API tried as a drop-in for mamba_ssm / flash-linear-attention: each test
pins a bug found that way (a wrong result, a crash, a silent acceptance or an unclear error). Small shapes; random
inputs, never zeros; relative error norm(diff) / norm(ref) against plain-PyTorch definitions."""

import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import ssd, ssd_reference, ssd_step
from kernels.compat import mamba_chunk_scan_combined, selective_state_update

from ._helpers import TRITON_DEVICE, make_inputs, needs_triton, rel


def _step_inputs(b=2, h=4, g=2, p=8, n=16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen)

    return dict(state=rn(b, h, p, n), x_t=rn(b, h, p), dt_t=torch.rand(b, h, generator=gen) * 0.5 + 0.05,
                A=-(torch.rand(h, generator=gen) + 0.1), B_t=rn(b, g, n) / n ** 0.5, C_t=rn(b, g, n) / n ** 0.5)


# ---------------------------------------------------------------------------------------------- the decode step

@needs_triton
def test_triton_step_with_a_permuted_x_writes_y_in_the_right_layout():
    """x_t (b, h, p) laid out as (b, p, h) (a projection's transpose): the output was allocated with x_t's strides
    while the kernel writes it contiguous, so y came back scrambled (1.4 relative error)."""
    t = {k: v.to(TRITON_DEVICE) for k, v in _step_inputs().items()}
    D = torch.randn(4, 8).to(TRITON_DEVICE)
    x_perm = t["x_t"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not x_perm.is_contiguous()
    y, new = ssd_step(t["state"], x_perm, t["dt_t"], t["A"], t["B_t"], t["C_t"], D=D, backend="triton")
    yr, nr = ssd_step(*(v.cpu() for v in t.values()), D=D.cpu(), backend="torch")
    assert rel(y, yr) < 1e-6 and rel(new, nr) < 1e-6
    assert y.is_contiguous() and new.is_contiguous()


def _definition_step(state, x, dt, A, B, C, D):
    """mamba_ssm's per-channel step in float64: dt (b, h, p), A (h, p, n), D (h, p)."""
    h = x.shape[1]
    Bh = B.double().repeat_interleave(h // B.shape[1], 1)[:, :, None]
    Ch = C.double().repeat_interleave(h // C.shape[1], 1)[:, :, None]
    new = torch.exp(dt.double()[..., None] * A.double()) * state.double() + (dt.double() * x.double())[..., None] * Bh
    return (new * Ch).sum(-1) + D.double() * x.double(), new


@pytest.mark.parametrize("h,p", [(4, 4), (4, 8)])
def test_selective_state_update_per_channel_dt_takes_a_per_head_D(h, p):
    """D (h,) is accepted by the argument check, but the per-channel (Mamba-1 style) path multiplied it into x's last
    dim: a broadcast error for h != p, and for h == p silently D[channel] in place of D[head]."""
    gen = torch.Generator().manual_seed(1)
    b, g, n = 2, 2, 16
    state = torch.randn(b, h, p, n, generator=gen)
    x, dt = torch.randn(b, h, p, generator=gen), torch.rand(b, h, p, generator=gen) * 0.5 + 0.05  # dt per channel
    A = -(torch.rand(h, p, n, generator=gen) + 0.1)
    B, C = torch.randn(b, g, n, generator=gen), torch.randn(b, g, n, generator=gen)
    D = torch.randn(h, generator=gen)
    s = state.clone()
    y = selective_state_update(s, x, dt, A, B, C, D=D)
    yr, nr = _definition_step(state, x, dt, A, B, C, D[:, None].expand(h, p))
    assert rel(y, yr) < 1e-6 and rel(s, nr) < 1e-6


# ------------------------------------------------------------------------------------------------ the scan

@pytest.mark.parametrize("backend", ["torch", "reference", pytest.param("triton", marks=needs_triton)])
def test_a_sequence_of_no_tokens_is_a_one_line_error(backend):
    """l = 0: the Triton path crashed the process (segmentation fault under the interpreter), the PyTorch path raised
    'stack expects a non-empty TensorList' from inside the scan."""
    ins, _ = make_inputs(2, 5, 4, 2, 8, 16, dtype=torch.float32, init=True)
    empty = {k: (v[:, :0] if k in ("x", "dt", "B", "C") else v) for k, v in ins.items()}
    if backend == "triton":
        empty = {k: v.to(TRITON_DEVICE) for k, v in empty.items()}
    with pytest.raises(ValueError, match=r"^ssd: x has no tokens \(l = 0\)"):
        ssd(**empty, return_final_state=True, backend=backend)
    with pytest.raises(ValueError, match=r"^mamba_chunk_scan_combined: x has no tokens"):
        mamba_chunk_scan_combined(empty["x"], empty["dt"], empty["A"], empty["B"], empty["C"], 64, backend=backend)


@needs_triton
def test_triton_scan_refuses_float64_up_front_and_auto_runs_it_on_torch():
    """float64 inputs on the Triton path: the forward ran (at fp32 accuracy) and the backward then failed with
    ``KeyError: torch.float64`` deep in ssd_triton_bwd. Now one line before any work; ``auto`` (a CUDA float64
    tensor) picks the PyTorch path, which computes in float64."""
    ins, _ = make_inputs(1, 20, 2, 1, 8, 16, dtype=torch.float64)
    ins = {k: v.to(TRITON_DEVICE).requires_grad_() for k, v in ins.items()}
    with pytest.raises(ValueError, match=r"^ssd: the Triton kernels take fp32, fp16 or bf16 x, got torch.float64"):
        ssd(**ins, backend="triton")

    class CudaFloat64:  # what auto sees for a float64 CUDA tensor
        is_cuda = True
        dtype = torch.float64

    assert kernels._scan_backend(CudaFloat64()) == "torch"
    assert kernels._scan_backend(CudaFloat64(), "triton") == "triton"  # an explicit choice is kept (and refused)
    state = torch.zeros(1, 2, 8, 16, dtype=torch.float64)
    assert kernels._scan_backend(torch.zeros(1, 2, 8, dtype=torch.float32), None, also=state) == "torch"


def test_auto_backend_names_a_non_tensor_x():
    """``ssd(list, ...)`` with the default backend raised ``AttributeError: 'list' object has no attribute
    'is_cuda'`` from the backend choice instead of the argument check's line."""
    ins, _ = make_inputs(1, 6, 2, 1, 4, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^ssd: x must be a tensor, got list"):
        ssd(ins["x"].tolist(), ins["dt"], ins["A"], ins["B"], ins["C"])


@needs_triton
def test_triton_scan_second_derivative_raises_instead_of_being_silently_zero():
    """``autograd.grad(..., create_graph=True)`` through the Triton scan returned a gradient with no graph: a
    gradient penalty built on it contributed nothing, silently. The backward is once-differentiable now."""
    ins, _ = make_inputs(1, 20, 2, 1, 8, 16, dtype=torch.float32)
    x = ins.pop("x").to(TRITON_DEVICE).requires_grad_()
    y = ssd(x, **{k: v.to(TRITON_DEVICE) for k, v in ins.items()}, backend="triton")
    (gx,) = torch.autograd.grad((y ** 2).sum(), x, create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.pow(2).sum().backward()


@needs_triton
def test_triton_step_second_derivative_raises_instead_of_being_silently_zero():
    t = {k: v.to(TRITON_DEVICE) for k, v in _step_inputs().items()}
    x = t.pop("x_t").requires_grad_()
    y, _ = ssd_step(t["state"], x, t["dt_t"], t["A"], t["B_t"], t["C_t"], backend="triton")
    (gx,) = torch.autograd.grad((y ** 2).sum(), x, create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.pow(2).sum().backward()


# ----------------------------------------------------------------------------------------- mamba_ssm's scan

def _raw_dt_inputs(seed=2):
    ins, _ = make_inputs(2, 23, 4, 2, 8, 16, dtype=torch.float64, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    ins["dt"] = torch.randn(2, 23, 4, generator=gen, dtype=torch.float64)  # raw: negative entries, no softplus
    assert (ins["dt"] < -0.5).any()
    return ins


@pytest.mark.parametrize("dt_limit,lo", [((0.0, math.inf), 0.0), ((-0.5, math.inf), -0.5)])
def test_compat_scan_clamps_dt_to_dt_limit_always_as_mamba_ssm(dt_limit, lo):
    """mamba_ssm's scan clamps dt to dt_limit unconditionally (``min(max(dt, lo), hi)``): with the default (0, inf)
    and no softplus a negative dt becomes 0, and a limit with lo <= 0 still applies. hmscale clamped only when
    lo > 0 or hi < inf, so a raw negative dt ran as a growing decay (y ~1.0 relative from mamba_ssm's)."""
    ins = _raw_dt_inputs()
    dt = ins["dt"].clone().requires_grad_()
    y = mamba_chunk_scan_combined(ins["x"], dt, ins["A"], ins["B"], ins["C"], 64, dt_limit=dt_limit, backend="torch")
    yr = ssd_reference(ins["x"], ins["dt"].clamp(min=lo), ins["A"], ins["B"], ins["C"])
    assert rel(y, yr) < 1e-10
    (g,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), dt)
    assert torch.all(g[ins["dt"] < lo] == 0) and g[ins["dt"] > lo].abs().sum() > 0  # clamped entries get none


def test_selective_state_update_still_does_not_clamp_dt():
    """mamba_ssm's decode step has no dt_limit: a negative dt (no softplus) stays negative there and here."""
    t = _step_inputs()
    b, h, p, n = t["state"].shape
    dt = -t["dt_t"]
    s = t["state"].clone()
    y = selective_state_update(s, t["x_t"], dt[..., None].expand(b, h, p), t["A"][:, None, None].expand(h, p, n),
                               t["B_t"], t["C_t"])
    yr, nr = _definition_step(t["state"], t["x_t"], dt[..., None].expand(b, h, p),
                              t["A"][:, None, None].expand(h, p, n), t["B_t"], t["C_t"], torch.zeros(h, p))
    assert rel(y, yr) < 1e-6 and rel(s, nr) < 1e-6


@pytest.mark.parametrize("kwargs,match", [
    (dict(dt_bias="meta"), r"^mamba_chunk_scan_combined: dt_bias is on meta but dt is on cpu"),
    (dict(dt_bias=[0.1, 0.2, 0.3, 0.4]), r"^mamba_chunk_scan_combined: dt_bias must be a floating-point tensor"),
    (dict(dt_limit=0.5), r"^mamba_chunk_scan_combined: dt_limit must be a \(min, max\) pair"),
    (dict(dt_limit=(0.1,)), r"^mamba_chunk_scan_combined: dt_limit must be a \(min, max\) pair"),
])
def test_compat_scan_bad_dt_options_are_one_line(kwargs, match):
    """A dt_bias on another device raised torch's 'Tensor on device meta is not on the expected device cpu!' from
    the addition; a list dt_bias an AttributeError; a scalar dt_limit 'cannot unpack non-iterable float'."""
    ins = _raw_dt_inputs()
    if kwargs.get("dt_bias") == "meta":
        kwargs = dict(dt_bias=torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match=match):
        mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 64, dt_softplus=True, **kwargs)


def test_compat_scan_softplus_and_default_limit_match_the_definition():
    """The usual Mamba-2 call (softplus, dt_bias, default limit) is unchanged by the always-on clamp."""
    ins = _raw_dt_inputs()
    bias = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 64, dt_bias=bias,
                                  dt_softplus=True, backend="torch")
    yr = ssd_reference(ins["x"], F.softplus(ins["dt"] + bias), ins["A"], ins["B"], ins["C"])
    assert rel(y, yr) < 1e-10
