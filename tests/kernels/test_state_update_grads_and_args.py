"""The kernel API on the CPU (compat drop-in, decode step, scan): state-update gradients and argument checks.

1. ``compat.selective_state_update`` with an input that requires grad: the step's autograd saved the state tensor it
   read, then the in-place update overwrote it, so ``backward`` raised "modified by an inplace operation" (both the
   Mamba-2 path through ``ssd_step`` and the per-channel PyTorch path, both backends). Now the step reads a copy when
   autograd records it, and the gradients match a float64 autograd of the formula.
2. A state of the wrong rank (not (b, h, p, n) nor (b, p, n)) was taken for the head-less form, and the error named
   x, not the state.
"""

import pytest
import torch
import torch.nn.functional as F

from kernels.compat import selective_state_update

from ._helpers import TRITON_DEVICE, needs_triton, rel


def _step_inputs(tied, b=2, h=4, g=2, p=3, n=5, pool=None, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    return dict(state=rn(pool or b, h, p, n), x=rn(b, h, p), dt=rn(b, h, 1 if tied else p),
                A=-(torch.rand(h, 1 if tied else p, 1, generator=gen, dtype=torch.float64) + 0.1), B=rn(b, g, n),
                C=rn(b, g, n), D=rn(h, p), z=rn(b, h, p), dt_bias=rn(h, 1 if tied else p))


def _formula(state_rows, x, dt, A, B, C, D, z, dt_bias, h, g):
    """float64: mamba_ssm's step with softplus, z gate and the D skip."""
    d = F.softplus(dt + dt_bias)
    Bh = B.repeat_interleave(h // g, 1)[:, :, None]
    Ch = C.repeat_interleave(h // g, 1)[:, :, None]
    new = torch.exp(d[..., None] * A) * state_rows + (d * x)[..., None] * Bh
    y = ((new * Ch).sum(-1) + D * x) * F.silu(z)
    return y, new


def _run(ins, tied, backend, dtype, sbi=None):
    """Leaves in ``dtype`` (requiring grad), dt / A / dt_bias expanded as mamba_ssm's callers pass them."""
    b, h, p = ins["x"].shape
    n = ins["state"].shape[-1]
    g = ins["B"].shape[1]
    dev = "cpu" if backend == "torch" else TRITON_DEVICE
    leaves = {k: v.detach().to(dev, dtype).clone().requires_grad_(k != "state") for k, v in ins.items()}
    state = leaves.pop("state")
    old = state.detach().clone()
    kw = dict(x=leaves["x"], dt=leaves["dt"].expand(b, h, p), A=leaves["A"].expand(h, p, n), B=leaves["B"],
              C=leaves["C"], D=leaves["D"], z=leaves["z"], dt_bias=leaves["dt_bias"].expand(h, p))
    if backend is None:  # the float64 formula
        rows = old if sbi is None else old[sbi]
        y, new = _formula(rows, **kw, h=h, g=g)
    else:
        y = selective_state_update(state, **kw, dt_softplus=True, state_batch_indices=sbi, backend=backend)
        new = state if sbi is None else state[sbi]
    gen = torch.Generator().manual_seed(7)
    (y.double() * torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.device)).sum().backward()
    return y.detach(), new.detach(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("tied", [True, False], ids=["per_head_ssd_step", "per_channel_torch"])
@pytest.mark.parametrize("use_sbi", [False, True], ids=["all_rows", "state_batch_indices"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_selective_state_update_backward_matches_float64(tied, use_sbi, backend):
    ins = _step_inputs(tied, pool=5 if use_sbi else None)
    sbi = torch.tensor([3, 0]) if use_sbi else None
    y64, new64, g64 = _run(ins, tied, None, torch.float64, sbi)
    y, new, grads = _run(ins, tied, backend, torch.float32, sbi)  # raised in backward before the fix
    assert rel(y, y64) < 1e-5 and rel(new, new64) < 1e-5
    for k, ref in g64.items():
        assert grads[k] is not None, f"no gradient for {k}"
        assert rel(grads[k], ref) < 1e-5, k


def test_selective_state_update_float64_torch_backward_is_exact():
    ins = _step_inputs(True)
    y64, new64, g64 = _run(ins, True, None, torch.float64)
    y, new, grads = _run(ins, True, "torch", torch.float64)
    assert rel(y, y64) < 1e-12 and rel(new, new64) < 1e-12
    for k, ref in g64.items():
        assert rel(grads[k], ref) < 1e-12, k


@pytest.mark.parametrize("shape", [(2, 4, 3, 5, 1), (3, 5)])
def test_selective_state_update_wrong_state_rank_names_state(shape):
    ins = _step_inputs(True)
    b, h, p = ins["x"].shape
    with pytest.raises(ValueError, match=r"^selective_state_update: state must be \(b, h, p, n\)"):
        selective_state_update(torch.randn(*shape, dtype=torch.float64), ins["x"], ins["dt"].expand(b, h, p),
                               ins["A"].expand(h, p, 5), ins["B"], ins["C"], backend="torch")


@pytest.mark.parametrize("heads", [True, False], ids=["state_bhpn", "state_bpn"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_selective_state_update_takes_B_C_without_the_group_dim(heads, backend):
    """mamba_ssm gives a 2-D B or C (b, n) its group dim (one group) whatever the state's rank, and keeps a 3-D one:
    B, C (b, n) with a (b, h, p, n) state raised "B must be (b, g, n)", and B, C (b, 1, n) with a (b, p, n) state
    became (b, 1, 1, n) and raised too."""
    ins = _step_inputs(True, g=1)
    b, h, p = ins["x"].shape
    n = ins["state"].shape[-1]
    y64, new64 = _formula(ins["state"], ins["x"], ins["dt"].expand(b, h, p), ins["A"].expand(h, p, n), ins["B"],
                          ins["C"], ins["D"], ins["z"], ins["dt_bias"].expand(h, p), h, 1)
    dev = "cpu" if backend == "torch" else TRITON_DEVICE
    f = {k: v.to(dev, torch.float32) for k, v in ins.items()}
    if heads:
        st, kw = f["state"].clone(), dict(x=f["x"], dt=f["dt"].expand(b, h, p), A=f["A"].expand(h, p, n),
                                          B=f["B"][:, 0], C=f["C"][:, 0], D=f["D"], z=f["z"],
                                          dt_bias=f["dt_bias"].expand(h, p))
        y = selective_state_update(st, **kw, dt_softplus=True, backend=backend)
    else:  # head 1 alone, as a head-less call with B, C kept (b, 1, n)
        st = f["state"][:, 1].clone()
        y = selective_state_update(st, f["x"][:, 1], f["dt"][:, 1].expand(b, p), f["A"][1].expand(p, n), f["B"],
                                   f["C"], D=f["D"][1], z=f["z"][:, 1], dt_bias=f["dt_bias"][1].expand(p),
                                   dt_softplus=True, backend=backend)
        y64, new64 = y64[:, 1], new64[:, 1]
    assert rel(y, y64) < 1e-5 and rel(st, new64) < 1e-5


@pytest.mark.parametrize("dtypes", [dict(dt=torch.float64, B=torch.bfloat16, C=torch.bfloat16),
                                    dict(x=torch.bfloat16, dt=torch.float64, B=torch.float32, C=torch.float32),
                                    dict(B=torch.float64, C=torch.float64)],
                         ids=["dt64_Bbf16", "xbf16_dt64", "B64"])
def test_varlen_states_with_mixed_input_dtypes(dtypes):
    """``return_varlen_states`` with inputs of mixed dtypes that the scan takes (a float64 dt beside fp32 / bf16 B,
    or float64 B beside an fp32 dt): the per-sequence states raised "expected scalar type Double but found Float".
    Now they are computed in the final state's dtype (fp32 here) and match the float64 scan of the same values."""
    from kernels import ssd_recurrent_reference
    from kernels.compat import mamba_chunk_scan_combined

    gen = torch.Generator().manual_seed(0)
    b, l, h, g, p, n = 1, 9, 4, 2, 3, 5

    def rn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    t = dict(x=rn(b, l, h, p), dt=rn(b, l, h), A=-(torch.rand(h, generator=gen, dtype=torch.float64) + 0.1),
             B=rn(b, l, g, n), C=rn(b, l, g, n), s0=rn(b, h, p, n), bias=rn(h))
    t = {k: v.to(dtypes.get(k, torch.float32)) for k, v in t.items()}
    cu, si = torch.tensor([0, 4, 5, 9]), torch.tensor([[0] * 4 + [1] + [2] * 4], dtype=torch.int32)
    y, fin, states = mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, dt_bias=t["bias"],
                                               initial_states=t["s0"], seq_idx=si, cu_seqlens=cu, dt_softplus=True,
                                               return_final_states=True, return_varlen_states=True, backend="torch")
    r = {k: v.double() for k, v in t.items()}
    d = F.softplus(r["dt"] + r["bias"])
    want = []
    for s, e in ((0, 4), (4, 5), (5, 9)):
        _, f = ssd_recurrent_reference(r["x"][:, s:e], d[:, s:e], r["A"], r["B"][:, s:e], r["C"][:, s:e],
                                       initial_state=r["s0"] if s == 0 else None, return_final_state=True)
        want.append(f[0])
    assert states.dtype == fin.dtype == torch.float32
    assert rel(states, torch.stack(want)) < 1e-5
    assert rel(states[-1], fin[0]) < 1e-5


@pytest.mark.parametrize("backend", [1, True, ["torch"]])
def test_non_string_backend_is_a_one_line_error(backend):
    """``backend=1`` (or any non-string) raised AttributeError ("'int' object has no attribute 'lower'") from the
    backend choice; now the ValueError that names the accepted backends, from the scan and the decode step."""
    from kernels import ssd, ssd_step

    gen = torch.Generator().manual_seed(0)
    x, dt, A = torch.randn(1, 3, 2, 4, generator=gen), torch.rand(1, 3, 2, generator=gen), -torch.rand(2, generator=gen)
    B, C = torch.randn(1, 3, 1, 5, generator=gen), torch.randn(1, 3, 1, 5, generator=gen)
    with pytest.raises(ValueError, match=r"^unknown SSD backend .*expected one of"):
        ssd(x, dt, A, B, C, backend=backend)
    with pytest.raises(ValueError, match=r"^unknown SSD backend .*expected one of"):
        ssd_step(torch.randn(1, 2, 4, 5), x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], backend=backend)


def test_the_triton_backends_own_refusals_name_the_function():
    """arg_checks promises every refusal starts with the function's name; the Triton backend's chunk-size check said
    only "chunk_size must be ..." (and its 2^31 one likewise)."""
    from kernels import ssd

    x = torch.randn(1, 32, 2, 8)
    dt = torch.rand(1, 32, 2)
    A = -torch.rand(2)
    B = torch.randn(1, 32, 1, 16)
    with pytest.raises(ValueError, match=r"^ssd: chunk_size must be a power of two >= 16 for the Triton kernel, got 24"):
        ssd(x, dt, A, B, B.clone(), chunk_size=24, backend="triton")
