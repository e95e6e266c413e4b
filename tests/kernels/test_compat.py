"""kernels.compat.mamba_chunk_scan_combined (mamba_ssm's signature) against its definition written out on the
float64 reference: dt + dt_bias, softplus, clamp to dt_limit, the scan with D, then y * silu(z). Random inputs;
tolerances: 1e-10 relative on the float64 torch path, 1e-5 on the fp32 Triton path (interpreter or GPU)."""

import math

import pytest
import torch
import torch.nn.functional as F

from kernels import ssd_reference
from kernels.compat import mamba_chunk_scan_combined

from ._helpers import TRITON_DEVICE, needs_triton, rel


def _inputs(dtype, b=2, l=37, h=4, g=2, p=12, n=16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    t = dict(x=rn(b, l, h, p), dt=rn(b, l, h), A=-(torch.rand(h, generator=gen, dtype=torch.float64) + 0.2),
             B=rn(b, l, g, n) / n ** 0.5, C=rn(b, l, g, n) / n ** 0.5, D=rn(h, p), z=rn(b, l, h, p),
             dt_bias=rn(h) * 0.5, initial_states=rn(b, h, p, n))
    seq_idx = torch.zeros(b, l, dtype=torch.int32)
    seq_idx[:, l // 3:] = 1
    seq_idx[-1, 2 * l // 3:] = 2
    for k in ("x", "B", "C", "z"):
        t[k] = t[k].to(dtype)
    if dtype != torch.float64:
        for k in ("dt", "A", "D", "dt_bias", "initial_states"):
            t[k] = t[k].float()
    return t, seq_idx


def _definition(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_limit):
    d = F.softplus(dt + dt_bias).clamp(*dt_limit)
    y, s = ssd_reference(x, d, A, B, C, D=D, initial_state=initial_states, seq_idx=seq_idx, return_final_state=True)
    return y * F.silu(z), s


def _with_grads(fn, ins, seq_idx, device):
    leaves = {k: v.to(device).clone().requires_grad_() for k, v in ins.items()}
    y, s = fn(**leaves, seq_idx=None if seq_idx is None else seq_idx.to(device))
    gen = torch.Generator().manual_seed(1)
    gy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    gs = torch.randn(s.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((y.double() * gy.to(device)).sum() + (s.double() * gs.to(device)).sum(),
                                list(leaves.values()))
    return y, s, dict(zip(leaves, grads))


LIMIT = (0.2, 1.5)  # inside softplus's range on these inputs: the clamp binds on both sides


def _ours(backend, dt_limit=LIMIT):
    def fn(**k):
        return mamba_chunk_scan_combined(**k, chunk_size=256, dt_softplus=True, dt_limit=dt_limit,
                                         return_final_states=True, backend=backend)
    return fn


def _ref(dt_limit=LIMIT):
    def fn(**k):
        return _definition(**k, dt_limit=dt_limit)
    return fn


def test_the_clamp_binds_on_these_inputs():
    ins, _ = _inputs(torch.float64)
    d = F.softplus(ins["dt"] + ins["dt_bias"])
    assert (d < LIMIT[0]).any() and (d > LIMIT[1]).any()


@pytest.mark.parametrize("dt_limit", [LIMIT, (0.0, math.inf)])
def test_torch_path_matches_definition(dt_limit):
    ins, seq = _inputs(torch.float64)
    y, s, g = _with_grads(_ours("torch", dt_limit), ins, seq, "cpu")
    yr, sr, gr = _with_grads(_ref(dt_limit), ins, seq, "cpu")
    assert rel(y, yr) < 1e-10 and rel(s, sr) < 1e-10
    for k in ins:
        assert rel(g[k], gr[k]) < 1e-10, k


@needs_triton
def test_triton_path_matches_definition():
    ins, seq = _inputs(torch.float32)
    y, s, g = _with_grads(_ours("triton"), ins, seq, TRITON_DEVICE)
    yr, sr, gr = _with_grads(_ref(), {k: v.double() for k, v in ins.items()}, seq, "cpu")
    assert y.dtype == torch.float32 and s.dtype == torch.float32
    assert rel(y, yr) < 1e-5 and rel(s, sr) < 1e-5
    for k in ins:
        assert rel(g[k], gr[k]) < 1e-5, k


def test_optional_arguments_off_is_the_plain_scan():
    ins, seq = _inputs(torch.float64)
    dt = ins["dt"].abs()  # the default dt_limit (0, inf) clamps a negative dt to 0, as mamba_ssm's
    y = mamba_chunk_scan_combined(ins["x"], dt, ins["A"], ins["B"], ins["C"], 64, backend="torch")
    yr = ssd_reference(ins["x"], dt, ins["A"], ins["B"], ins["C"])
    assert rel(y, yr) < 1e-10


def test_softplus_is_the_identity_above_20():
    ins, _ = _inputs(torch.float64)
    dt = ins["dt"].abs() + 25.0  # softplus(dt) == dt to double precision there too
    y = mamba_chunk_scan_combined(ins["x"], dt, ins["A"] * 0.01, ins["B"], ins["C"], 64, dt_softplus=True,
                                  backend="torch")
    yr = ssd_reference(ins["x"], dt, ins["A"] * 0.01, ins["B"], ins["C"])
    assert rel(y, yr) < 1e-10


def _packed(l=53, cuts=(0, 9, 10, 31, 53)):
    """Batch 1, sequences packed along l at ``cuts``: inputs, seq_idx and cu_seqlens."""
    ins, _ = _inputs(torch.float64, b=1, l=l)
    cu = torch.tensor(cuts, dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(cuts) - 1, dtype=torch.int32), cu.diff().long())[None]
    return ins, seq_idx, cu


@pytest.mark.parametrize("cuts,with_seq_idx", [((0, 9, 10, 31, 53), True), ((0, 53), False)])
@pytest.mark.parametrize("initial", [True, False])
def test_varlen_states_are_the_scans_state_at_each_sequence_end(cuts, with_seq_idx, initial):
    ins, seq_idx, cu = _packed(cuts=cuts)
    seq = seq_idx if with_seq_idx else None
    init = ins["initial_states"] if initial else None
    kw = dict(D=ins["D"], z=ins["z"], dt_bias=ins["dt_bias"], dt_softplus=True, dt_limit=LIMIT, backend="torch")
    y, final, varlen = mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 64, initial_states=init,
                                                 seq_idx=seq, cu_seqlens=cu, return_final_states=True,
                                                 return_varlen_states=True, **kw)
    y_only, varlen_only = mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 64, initial_states=init,
                                                    seq_idx=seq, cu_seqlens=cu, return_varlen_states=True, **kw)
    assert torch.equal(y, y_only) and torch.equal(varlen, varlen_only) and varlen.shape == (len(cuts) - 1, 4, 12, 16)
    d = F.softplus(ins["dt"] + ins["dt_bias"]).clamp(*LIMIT)
    for i, e in enumerate(cu[1:].tolist()):  # the definition: the final state of the scan cut after the sequence
        _, want = ssd_reference(ins["x"][:, :e], d[:, :e], ins["A"], ins["B"][:, :e], ins["C"][:, :e], initial_state=init,
                                seq_idx=None if seq is None else seq[:, :e], return_final_state=True)
        assert rel(varlen[i], want[0]) < 1e-12, i
    assert rel(varlen[-1], final[0]) < 1e-12


@pytest.mark.parametrize("kwargs,match", [
    (dict(return_varlen_states=True), "return_varlen_states needs cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 5, 37]), return_varlen_states=True), "supports batch 1"),
    (dict(dt_bias=torch.zeros(3)), r"dt_bias must be \(h,\)"),
    (dict(z=torch.zeros(1, 2, 3)), "z must have x's shape"),
])
def test_unsupported_or_bad_arguments_say_what_to_change(kwargs, match):
    ins, _ = _inputs(torch.float64)
    with pytest.raises(ValueError, match=match):
        mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 64, backend="torch", **kwargs)


def test_bad_chunk_setting_is_one_line(monkeypatch):
    monkeypatch.setenv("HMSCALE_COMPAT_CHUNK", "48")
    ins, _ = _inputs(torch.float64)
    with pytest.raises(ValueError, match="HMSCALE_COMPAT_CHUNK must be a power of two"):
        mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 64, backend="torch")


# ---------------------------------------------------------------- selective_state_update (one decode step)

from kernels.compat import selective_state_update  # noqa: E402


def _step_inputs(b=3, h=4, g=2, p=6, n=8, pool=None, seed=3, tied=False):
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    t = dict(x=rn(b, h, p), B=rn(b, g, n), C=rn(b, g, n), D=rn(h, p), z=rn(b, h, p))
    if tied:  # Mamba-2: one dt, A and dt_bias per head, passed expanded with stride 0
        t["dt"] = rn(b, h)[..., None].expand(b, h, p)
        t["A"] = (-(torch.rand(h, generator=gen, dtype=torch.float64) + 0.2))[:, None, None].expand(h, p, n)
        t["dt_bias"] = (rn(h) * 0.5)[:, None].expand(h, p)
    else:
        t["dt"], t["A"], t["dt_bias"] = rn(b, h, p), -(torch.rand(h, p, n, generator=gen, dtype=torch.float64) + 0.2), rn(h, p)
    state = rn(pool or b, h, p, n)
    return t, state


def _step_definition(state, x, dt, A, B, C, D, z, dt_bias):
    h, g = x.shape[1], B.shape[1]
    d = F.softplus(dt + dt_bias)
    Bh, Ch = B.repeat_interleave(h // g, 1)[:, :, None], C.repeat_interleave(h // g, 1)[:, :, None]
    new = torch.exp(d[..., None] * A) * state + (d * x)[..., None] * Bh
    return ((new * Ch).sum(-1) + D * x) * F.silu(z), new


@pytest.mark.parametrize("tied", [False, True])
def test_step_matches_its_definition_and_updates_the_state_in_place(tied):
    t, state = _step_inputs(tied=tied)
    want_y, want_state = _step_definition(state, **t)
    s = state.clone()
    y = selective_state_update(s, **t, dt_softplus=True, backend="torch")
    assert rel(y, want_y) < 1e-12 and rel(s, want_state) < 1e-12


def test_step_with_state_batch_indices_touches_only_those_rows():
    t, pool = _step_inputs(pool=6, b=2)
    idx = torch.tensor([4, 1])
    want_y, want_rows = _step_definition(pool[idx], **t)
    s = pool.clone()
    y = selective_state_update(s, **t, dt_softplus=True, state_batch_indices=idx, backend="torch")
    assert rel(y, want_y) < 1e-12 and rel(s[idx], want_rows) < 1e-12
    keep = [0, 2, 3, 5]
    assert torch.equal(s[keep], pool[keep])


def test_step_without_heads():
    t, state = _step_inputs(h=1, g=1)
    want_y, want_state = _step_definition(state, **t)
    s = state[:, 0].clone()
    one = {k: v[:, 0] if k in ("x", "dt", "z", "B", "C") else v[0] for k, v in t.items()}
    y = selective_state_update(s, **one, dt_softplus=True, backend="torch")
    assert y.shape == want_y[:, 0].shape and rel(y, want_y[:, 0]) < 1e-12 and rel(s, want_state[:, 0]) < 1e-12


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_stepping_through_a_sequence_gives_the_chunked_scan(backend):
    """Tied (Mamba-2) decode steps, token by token, reproduce mamba_chunk_scan_combined's outputs and final state."""
    b, l, h, g, p, n = 2, 11, 4, 2, 6, 8
    dtype = torch.float64 if backend == "torch" else torch.float32
    ins, _ = _inputs(dtype, b=b, l=l, h=h, g=g, p=p, n=n, seed=5)
    ins = {k: v for k, v in ins.items() if k != "initial_states"}
    dev = "cpu" if backend == "torch" else TRITON_DEVICE
    ins = {k: v.to(dev) for k, v in ins.items()}
    y, final = mamba_chunk_scan_combined(**ins, chunk_size=64, dt_softplus=True, return_final_states=True,
                                         backend=backend)
    state = torch.zeros(b, h, p, n, dtype=torch.float64 if backend == "torch" else torch.float32, device=dev)
    outs = []
    for t in range(l):
        outs.append(selective_state_update(
            state, ins["x"][:, t], ins["dt"][:, t, :, None].expand(b, h, p), ins["A"][:, None, None].expand(h, p, n),
            ins["B"][:, t], ins["C"][:, t], D=ins["D"], z=ins["z"][:, t], dt_bias=ins["dt_bias"][:, None].expand(h, p),
            dt_softplus=True, backend=backend))
    tol = 1e-10 if backend == "torch" else 1e-5
    assert rel(torch.stack(outs, 1), y) < tol and rel(state, final) < tol


def test_step_shape_errors_say_what_is_expected():
    t, state = _step_inputs()
    with pytest.raises(ValueError, match=r"must be \(b, h, p, n\), \(b, h, p\), \(b, h, p\) and \(h, p, n\)"):
        selective_state_update(state[:, :, :3], **t, backend="torch")


@pytest.mark.parametrize("cuts", [(0, 20, 20, 53), (1, 53), (0, 52), (0, 30, 20, 53), ((0, 53),), 53])
def test_bad_cu_seqlens_are_one_line(cuts):
    ins, seq_idx, _ = _packed()
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly from 0 to l = 53"):
        mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 64, seq_idx=seq_idx,
                                  cu_seqlens=torch.tensor(cuts), return_varlen_states=True, backend="torch")


def test_several_sequences_need_a_seq_idx_that_agrees():
    ins, seq_idx, cu = _packed()
    with pytest.raises(ValueError, match="needs seq_idx"):
        mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 64, cu_seqlens=cu,
                                  return_varlen_states=True, backend="torch")
    for wrong in (torch.zeros_like(seq_idx), torch.roll(seq_idx, 1, dims=1)):
        with pytest.raises(ValueError, match=r"seq_idx must change exactly where cu_seqlens starts a sequence \(\[9, 10, 31\]\)"):
            mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 64, seq_idx=wrong,
                                      cu_seqlens=cu, return_varlen_states=True, backend="torch")


def test_a_wrong_seq_idx_is_named_before_varlen_reads_it():
    ins, seq_idx, cu = _packed()
    with pytest.raises(ValueError, match=r"^mamba_chunk_scan_combined: seq_idx must be \(b, l\) = \(1, 53\)"):
        mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 64, seq_idx=seq_idx[0],
                                  cu_seqlens=cu, return_varlen_states=True, backend="torch")
