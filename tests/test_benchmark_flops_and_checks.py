"""What the benchmark scripts compute and report (BENCHMARKS.md's figures come from them): FLOP counts against a
hand count on tiny shapes, and the GPU check's verdicts. Pure functions only: no GPU, no timing."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load(script, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(REPO / "benchmarks"), str(REPO), *sys.path])
    spec = importlib.util.spec_from_file_location(f"walk13_{script[:-3]}", REPO / "benchmarks" / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ssd_hand_count(b, l, h, g, p, n, Q):
    """The chunked SSD's matmuls, one by one, per chunk (l a multiple of Q): C_c B_c^T once per group (B/C are
    shared by the heads of a group), then per head the masked (C B^T) x_c, the chunk state B_c^T x_c and the
    inter-chunk output C_c S."""
    chunks = l // Q
    per_chunk = g * (2 * Q * Q * n) + h * (2 * Q * Q * p + 2 * Q * n * p + 2 * Q * n * p)
    return b * chunks * per_chunk


@pytest.mark.parametrize("b,l,h,g,p,n", [(1, 128, 2, 2, 4, 8), (2, 192, 4, 1, 8, 16), (1, 64, 8, 2, 16, 4)])
def test_ssd_flops_match_a_hand_count(b, l, h, g, p, n, monkeypatch):
    """benchmarks/ssd.py's forward count is the chunked algorithm's: C.B^T is one product per group, not per head
    (it counted it per head, which overstated the mamba2 shape's (H=64, G=1) TFLOP/s by 1.39x); fwd+bwd is 3x fwd
    (the backward: two matmuls per forward matmul)."""
    ssd = _load("ssd.py", monkeypatch)
    fwd, fb = ssd.ssd_flops(b, l, h, p, n, Q=64, g=g)
    assert fwd == _ssd_hand_count(b, l, h, g, p, n, 64)
    assert fb == 3 * fwd
    if g == h:  # the HedgeMamba shapes (one head per group): the docstring's 2Q(N+P) + 4PN per token and head
        assert fwd == b * l * h * (2 * 64 * (n + p) + 4 * p * n)


def test_sdpa_flops_match_a_hand_count_and_the_ssd_convention(monkeypatch):
    """Causal SDPA: QK^T and PV, each 2 l^2 P per head, halved by the mask; fwd+bwd under the same convention as the
    SSD's count (backward = 2x forward: dQ, dK, dV, dP), so the TFLOP/s columns compare. It used 2.5x fwd for
    fwd+bwd (a backward of 1.5x the forward, which no convention gives: FlashAttention's own counts 2.5x for the
    backward alone), understating SDPA's fwd+bwd TFLOP/s by 1.2x."""
    ssd = _load("ssd.py", monkeypatch)
    b, h, l, p = 2, 3, 16, 8
    qk = 2 * l * l * p  # one head's full QK^T
    pv = 2 * l * l * p
    fwd, fb = ssd.sdpa_flops(b, h, l, p)
    assert fwd == b * h * (qk + pv) / 2
    _, ssd_fb = ssd.ssd_flops(1, 64, 1, 4, 4, g=1)
    assert fb / fwd == ssd_fb / ssd.ssd_flops(1, 64, 1, 4, 4, g=1)[0] == 3


def test_gpu_check_cases_fail_on_nan_wherever_it_is(monkeypatch, capsys):
    """ssd_gpu_check.py --case: a NaN error (an output element never written, or a NaN gradient) fails the case
    whichever output it is in; max() over the errors dropped a NaN unless it came first, so a NaN dB passed."""
    chk = _load("ssd_gpu_check.py", monkeypatch)
    monkeypatch.setattr(chk, "DEV", "cpu")
    errs = {"y": 1e-6, "final": 1e-6, "dx": float("nan"), "dB": 1e-6}  # fp32: limit 1e-4
    monkeypatch.setattr(chk, "run_case", lambda *a, **k: dict(errs))
    assert chk.chosen_cases(["32,16,2,plain"], [0], [torch.float32], 70, 8, 64) == 1
    assert "FAIL" in capsys.readouterr().out
    errs["dx"] = 2e-6
    assert chk.chosen_cases(["32,16,2,plain"], [0], [torch.float32], 70, 8, 64) == 0


def test_gpu_check_charges_the_kernel_only_for_its_own_rounding(monkeypatch):
    """ssd_gpu_check.py compares ours to the float64 reference "on the same (rounded) inputs"; the output's
    cotangent is one of them. A bf16 kernel that computed exactly on its inputs must show gradient errors at
    rounding-free level; with the reference fed the unrounded fp32 cotangent it showed ~1e-3 (a tenth of the
    bf16 limit) that came from the check, not the kernel."""
    chk = _load("ssd_gpu_check.py", monkeypatch)
    monkeypatch.setattr(chk, "DEV", "cpu")

    def exact(x, dt, A, B, C, **kw):  # the reference in fp32 on the rounded inputs, output in the input dtype
        y, fs = chk.ssd_reference(x.float(), dt, A, B.float(), C.float(), **kw)
        return y.to(x.dtype), fs

    monkeypatch.setattr(chk, "ssd_triton", exact)
    gen = torch.Generator().manual_seed(0)
    errs = chk.run_case(1, 40, 2, 2, 8, 8, torch.bfloat16, chk.OPTION_SETS["plain"], gen, chunk=16)
    # y and the bf16 inputs' gradients are rounded to bf16 (the kernel's to carry); the fp32 ones are exact
    for k in ("final", "ddt", "dA"):
        assert errs[k] < 1e-5, (k, errs)


def test_compat_check_case_errors_keep_a_nan(monkeypatch):
    """compat_check.py's verdict on a case takes the worst field: a NaN in any field (here ours' dB, not the first)
    reaches agree(), which fails it; max() over the fields used to drop it unless it came first."""
    cc = _load("compat_check.py", monkeypatch)
    t = torch.ones(4)
    ref = {"y": t, "final": t, "dB": t}
    them = {k: v * (1 + 1e-6) for k, v in ref.items()}
    ours = dict(them, dB=torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    worst, e_vs, ours_ref, them_ref = cc.case_errors(ours, them, ref)
    assert worst == "dB" and e_vs != e_vs and ours_ref != ours_ref and them_ref < 1e-5
    assert not cc.agree(e_vs, ours_ref, them_ref, 1e-4)
    worst, e_vs, ours_ref, them_ref = cc.case_errors(them, them, ref)  # and a clean case still passes
    assert e_vs == 0 and cc.agree(e_vs, ours_ref, them_ref, 1e-4)
