"""The public SSD API on mistaken arguments: a one-line ValueError naming the argument, from every backend, before
any work (shapes, dtypes and devices only: nothing reads tensor data); and valid-but-unusual inputs (D (h, 1),
int64 / non-monotone seq_idx, bf16 on the Triton path) computing what the float64 reference does."""

import pytest
import torch

import kernels
from kernels import ssd, ssd_reference, ssd_step
from kernels.compat import mamba_chunk_scan_combined, selective_state_update
from kernels.step import ssd_step_torch

from ._helpers import TRITON_DEVICE, make_inputs, needs_triton, rel

BACKENDS = ["torch", "reference", pytest.param("triton", marks=needs_triton)]
STEP_BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
b, l, h, g, p, n = 2, 21, 4, 2, 16, 16


def _ssd_inputs(device="cpu"):
    ins, seq = make_inputs(b, l, h, g, p, n, dtype=torch.float32, D=True, init=True, seq=True)
    return {k: v.to(device) for k, v in ins.items()}, seq.to(device)


def _bad_ssd_cases():
    gen = torch.Generator().manual_seed(7)

    def rn(*s):
        return torch.randn(*s, generator=gen)

    return [
        ("dt (b,l,h,1)", dict(dt=lambda t: t[..., None]), r"dt must be \(b, l, h\) = \(2, 21, 4\).*dt\[\.\.\., 0\]"),
        ("dt (b,h,l)", dict(dt=lambda t: t.transpose(1, 2).contiguous()), r"dt must be \(b, l, h\)"),
        ("A (h,1)", dict(A=lambda t: t[:, None]), r"A must be \(h,\) = \(4,\), got \(4, 1\)"),
        ("A (h,p,n)", dict(A=lambda t: t[:, None, None].expand(h, p, n)), r"A must be \(h,\).*per-channel"),
        ("B with g=3", dict(B=lambda t: rn(b, l, 3, n), C=lambda t: rn(b, l, 3, n)), r"B must be \(b, l, g, n\)"),
        ("B (b,l,n)", dict(B=lambda t: t[:, :, 0], C=lambda t: t[:, :, 0]), r"B must be .*add the group dim"),
        ("C other n", dict(C=lambda t: t[..., :8]), r"B and C must have one shape"),
        ("D (p,)", dict(D=lambda t: rn(p)), r"D must be \(h,\)"),
        ("initial_state other n", dict(initial_state=lambda t: rn(b, h, p, n + 1)),
         r"initial_state must be \(b, h, p, n\) = \(2, 4, 16, 16\)"),
        ("initial_state without batch", dict(initial_state=lambda t: t[0]), r"initial_state must be"),
        ("initial_state with a normaliser row", dict(initial_state=lambda t: rn(b, h, p + 1, n)), r"initial_state must be"),
        ("seq_idx (l,)", dict(seq_idx=lambda t: t[0]), r"seq_idx must be \(b, l\)"),
        ("seq_idx (b,l+1)", dict(seq_idx=lambda t: torch.cat([t, t[:, -1:]], 1)), r"seq_idx must be \(b, l\)"),
        ("seq_idx float", dict(seq_idx=lambda t: t.float()), r"seq_idx must be an integer tensor"),
        ("int x", dict(x=lambda t: (t * 4).long()), r"x must be a floating-point tensor, got torch.int64"),
        ("int B", dict(B=lambda t: (t * 4).int(), C=lambda t: (t * 4).int()), r"B must be a floating-point"),
        ("x 3d", dict(x=lambda t: t[0]), r"x must be \(b, l, h, p\)"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _bad_ssd_cases(), ids=lambda c: c[0])
def test_ssd_wrong_argument_is_one_line_naming_it(case, backend):
    _, changes, match = case
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    ins, seq = _ssd_inputs(dev)
    kw = dict(ins, seq_idx=seq)
    for k, f in changes.items():
        kw[k] = f(kw[k]).to(dev)
    with pytest.raises(ValueError, match="^ssd: " + match):
        ssd(**kw, return_final_state=True, backend=backend)


@pytest.mark.parametrize("chunk", [0, -64, 2.5])
def test_ssd_chunk_size_must_be_a_positive_int(chunk):
    ins, seq = _ssd_inputs()
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        ssd(**ins, seq_idx=seq, chunk_size=chunk, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["dt", "B", "initial_state", "seq_idx"])
def test_ssd_tensors_on_another_device_are_named(which, backend):
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    ins, seq = _ssd_inputs(dev)
    kw = dict(ins, seq_idx=seq)
    kw[which] = kw[which].to("meta")  # a second device every machine has
    with pytest.raises(ValueError, match=f"{which} is on meta but x is on {dev}"):
        ssd(**kw, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_d_per_head_as_h1_and_int64_non_monotone_seq_idx_match_reference(backend):
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    ins, _ = _ssd_inputs(dev)
    seq = torch.zeros(b, l, dtype=torch.int64)
    seq[:, 7:] = 5
    seq[:, 15:] = 2  # falls: still a new document where it changes
    ins["D"] = ins["D"][:, None]  # (h, 1)
    y, s = ssd(**ins, seq_idx=seq.to(dev), return_final_state=True, backend=backend)
    yr, sr = ssd_reference(**{k: v.double().cpu() for k, v in ins.items()}, seq_idx=seq, return_final_state=True)
    assert rel(y, yr) < 1e-5 and rel(s, sr) < 1e-5


@needs_triton
def test_triton_ssd_widens_interpreter_bf16_dots_itself(monkeypatch):
    """Under TRITON_INTERPRET=1 kernels.ssd applies kernels.interpreter's bf16 fix itself (without it bf16 outputs
    were 1e9 off on the CPU); a no-op on the GPU."""
    import kernels.interpreter as interp

    calls = []
    real = interp.patch_interpreter_bf16_dot
    monkeypatch.setattr(interp, "patch_interpreter_bf16_dot", lambda: calls.append(1) or real())
    ins, seq = _ssd_inputs(TRITON_DEVICE)
    for k in ("x", "B", "C"):
        ins[k] = ins[k].bfloat16()
    y = ssd(**ins, seq_idx=seq, backend="triton")
    yr = ssd_reference(**{k: v.double().cpu() for k, v in ins.items()}, seq_idx=seq.cpu())
    import os
    assert calls == ([1] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    assert y.dtype == torch.bfloat16 and rel(y, yr) < 2e-2


# ------------------------------------------------------------------------------------------------ ssd_step

def _step_inputs(device="cpu"):
    gen = torch.Generator().manual_seed(3)

    def rn(*s):
        return torch.randn(*s, generator=gen).to(device)

    return dict(state=rn(b, h, p, n), x_t=rn(b, h, p), dt_t=(rn(b, h).abs() + 0.1), A=-(rn(h).abs() + 0.1),
                B_t=rn(b, g, n) / 4, C_t=rn(b, g, n) / 4, D=rn(h, p))


STEP_CASES = [
    ("state other n", dict(state=lambda t: torch.randn(b, h, p, n + 4)), r"state must be \(b, h, p, n\) = \(2, 4, 16, 16\)"),
    ("state without batch", dict(state=lambda t: t[0]), r"state must be \(b, h, p, n\)"),
    ("state with normaliser row", dict(state=lambda t: torch.randn(b, h, p + 1, n)), r"state must be"),
    ("dt (b,h,p)", dict(dt_t=lambda t: t[..., None].expand(b, h, p)), r"dt_t must be \(b, h\).*dt_t\[\.\.\., 0\]"),
    ("A (h,p,n)", dict(A=lambda t: t[:, None, None].expand(h, p, n)), r"A must be \(h,\)"),
    ("g=3", dict(B_t=lambda t: torch.randn(b, 3, n), C_t=lambda t: torch.randn(b, 3, n)), r"B_t must be \(b, g, n\)"),
    ("C other n", dict(C_t=lambda t: t[..., :8]), r"B_t and C_t must have one shape"),
    ("D (p,)", dict(D=lambda t: torch.randn(p)), r"D must be \(h,\)"),
    ("x with l", dict(x_t=lambda t: t[:, None]), r"x_t must be \(b, h, p\).*one token"),
    ("int x", dict(x_t=lambda t: (t * 4).long()), r"x_t must be a floating-point tensor"),
    ("dt on meta", dict(dt_t=lambda t: t.to("meta")), r"dt_t is on meta"),
]


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: c[0])
def test_step_wrong_argument_is_one_line_naming_it(case, backend):
    _, changes, match = case
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    kw = _step_inputs(dev)
    for k, f in changes.items():
        kw[k] = f(kw[k])
        if kw[k].device.type != "meta":
            kw[k] = kw[k].to(dev)
    with pytest.raises(ValueError, match="^ssd_step: " + match):
        ssd_step(**kw, backend=backend)


# ------------------------------------------------------------------------------------------------ compat

def test_compat_scan_names_a_wrong_dt_not_dt_bias():
    ins, seq = _ssd_inputs()
    with pytest.raises(ValueError, match=r"^mamba_chunk_scan_combined: dt must be \(b, l, h\)"):
        mamba_chunk_scan_combined(ins["x"], ins["dt"][..., None], ins["A"], ins["B"], ins["C"], 256,
                                  dt_bias=torch.randn(h), dt_softplus=True, backend="torch")
    with pytest.raises(ValueError, match=r"^mamba_chunk_scan_combined: initial_states must be"):
        mamba_chunk_scan_combined(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], 256,
                                  initial_states=ins["initial_state"][0], backend="torch")


def _ssu_inputs():
    kw = _step_inputs()
    st = kw.pop("state")
    t = dict(x=kw["x_t"], dt=kw["dt_t"][..., None].expand(b, h, p), A=kw["A"][:, None, None].expand(h, p, n),
             B=kw["B_t"], C=kw["C_t"], D=kw["D"], z=torch.randn(b, h, p))
    return t, st


@pytest.mark.parametrize("change,match", [
    (dict(C=lambda t: t[..., :8]), r"C must be \(b, g, n\) with b = 2, n = 16"),
    (dict(B=lambda t: torch.randn(b, 3, n)), r"B must be \(b, g, n\)"),
    (dict(dt_bias=lambda t: torch.randn(h, 1)), r"dt_bias must be \(h, p\) = \(4, 16\)"),
    (dict(D=lambda t: torch.randn(p)), r"D must be \(h, p\)"),
    (dict(z=lambda t: t[..., :4]), r"z must have x's shape"),
    (dict(state_batch_indices=lambda t: torch.tensor([0.0, 1.0])), r"state_batch_indices must be an integer tensor"),
    (dict(x=lambda t: t.long()), r"x must be a floating-point tensor"),
])
def test_selective_state_update_wrong_argument_is_one_line(change, match):
    t, st = _ssu_inputs()
    t.setdefault("dt_bias", None)
    t.setdefault("state_batch_indices", None)
    for k, f in change.items():
        t[k] = f(t[k])
    before = st.clone()
    with pytest.raises(ValueError, match="^selective_state_update: " + match):
        selective_state_update(st, **t, dt_softplus=True, backend="torch")
    assert torch.equal(st, before)  # nothing written


@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_selective_state_update_takes_a_per_head_dt_bias(backend):
    """dt_bias (h,) (Mamba-2's parameter as stored) is one bias per head: the same as passing it expanded (h, p)."""
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    t, st = _ssu_inputs()
    t = {k: v.to(dev) for k, v in t.items()}
    bias = torch.randn(h).to(dev)
    s1, s2 = st.clone().to(dev), st.clone().to(dev)
    y1 = selective_state_update(s1, **t, dt_bias=bias, dt_softplus=True, backend=backend)
    y2 = selective_state_update(s2, **t, dt_bias=bias[:, None].expand(h, p), dt_softplus=True, backend=backend)
    d = torch.nn.functional.softplus(t["dt"][..., 0].double().cpu() + bias.double().cpu())
    yr, sr = ssd_step_torch(st.double(), t["x"].double().cpu(), d, t["A"][:, 0, 0].double().cpu(),
                            t["B"].double().cpu(), t["C"].double().cpu(), D=t["D"].double().cpu())
    yr = yr * torch.nn.functional.silu(t["z"].double().cpu())
    assert torch.equal(y1, y2) and torch.equal(s1, s2)
    assert rel(y1, yr) < 1e-5 and rel(s1, sr) < 1e-5


def test_public_checkers_are_exported():
    assert kernels.check_ssd_args is kernels.chunked_torch.check_ssd_args
    assert "check_ssd_args" in kernels.__all__
