"""Triton kernels (under TRITON_INTERPRET=1 on CPU, or on a GPU) vs the float64 reference: outputs, final state and
all gradients, over every option. Inputs fp32; tolerance 1e-5 relative (||diff|| / ||ref||)."""

import os

import pytest
import torch

from kernels import ssd, ssd_reference

from ._helpers import TRITON_DEVICE, make_inputs, on_triton_device, rel

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a GPU")

TOL = 1e-5

CASES = [  # (shape, chunk, options)
    (dict(b=1, l=40, h=2, g=2, p=20, n=16), 16, dict()),                                # g = h, P not 2^k
    (dict(b=2, l=37, h=4, g=1, p=20, n=24), 16, dict(D=True, init=True)),              # g = 1, l % Q != 0
    (dict(b=2, l=50, h=4, g=2, p=40, n=16), 32, dict(seq=True, init=True)),            # 1 < g < h
    (dict(b=1, l=45, h=3, g=1, p=8, n=40), 16, dict(normalize=True, D=True, init=True, seq=True)),
    (dict(b=1, l=20, h=2, g=2, p=16, n=80), 16, dict(normalize=True)),                # N > BN: n tiles
    (dict(b=1, l=33, h=2, g=1, p=72, n=16), 16, dict(D=True, seq=True)),              # P > BP: p tiles
    (dict(b=2, l=10, h=2, g=1, p=16, n=16), 16, dict(init=True, seq=True)),           # l < one chunk
    (dict(b=1, l=170, h=2, g=1, p=8, n=16), 16, dict(init=True, seq=True)),           # 11 chunks: state-pass prefetch
]


def _run(fn, ins, seq, opts, chunk, gy=None, gs=None, device="cpu"):
    """fn on ins (moved to `device`) with gradients from gy, gs (random when not given; returned on the CPU)."""
    ins, seq = ({k: v.to(device) for k, v in ins.items()}, None if seq is None else seq.to(device))
    leaves = {k: v.clone().requires_grad_() for k, v in ins.items()}
    y, s = fn(**leaves, chunk_size=chunk, seq_idx=seq, normalize=opts.get("normalize", False),
              return_final_state=True)
    if gy is None:
        gen = torch.Generator().manual_seed(1)
        gy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        gs = torch.randn(s.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((y.double() * gy.to(device)).sum() + (s.double() * gs.to(device)).sum(),
                                list(leaves.values()))
    return y, s, dict(zip(leaves, grads)), gy.cpu(), gs.cpu()


def _triton(**k):
    return ssd(**k, backend="triton")


@pytest.mark.parametrize("bwd,state_pass,order,unroll", [("v1", "split", "chunk", "1"), ("v2", "split", "chunk", "1"),
                                                         ("v2", "fused", "tile", "1"), ("v2", "fused", "tile", "2")])
@pytest.mark.parametrize("shape,chunk,opts", CASES)
def test_triton_matches_reference(shape, chunk, opts, bwd, state_pass, order, unroll, monkeypatch):
    monkeypatch.setenv("HMSCALE_SSD_WALK_UNROLL", unroll)  # the fused passes' walks, one or two chunks per step
    monkeypatch.setenv("HMSCALE_SSD_BWD", bwd)
    monkeypatch.setenv("HMSCALE_SSD_PASS", state_pass)
    monkeypatch.setenv("HMSCALE_SSD_TILE_ORDER", order)  # launch order of the dx / dB-dC tiles
    ins, seq = make_inputs(**shape, **opts, dtype=torch.float32)
    y, s, g, gy, gs = _run(_triton, ins, seq, opts, chunk, device=TRITON_DEVICE)
    ins64 = {k: v.double() for k, v in ins.items()}
    yr, sr, gr, _, _ = _run(ssd_reference, ins64, seq, opts, chunk, gy, gs)
    assert y.dtype == torch.float32 and s.dtype == torch.float32
    assert rel(y, yr) < TOL
    assert rel(s, sr) < TOL
    for k in g:
        assert torch.isfinite(g[k]).all(), k
        assert rel(g[k], gr[k]) < TOL, (k, rel(g[k], gr[k]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[5]])
def test_fused_passes_narrow_tiles(case, dtype, monkeypatch):
    """The fused passes with state tiles narrower in N than in P (BN < BP), where the chunk weights scale the B / C
    rows instead of x / dy: the same results as the reference (fp32 at 1e-5; bf16 inputs at 1e-2, and the final
    state, carried in fp32, at 1e-4), with both walk unrolls."""
    shape, chunk, opts = case
    monkeypatch.setenv("HMSCALE_SSD_PASS", "fused")
    monkeypatch.setenv("HMSCALE_SSD_CFG", "fpass=32,16;fpass_b=32,16")
    ins, seq = make_inputs(**shape, **opts, dtype=dtype)
    ins64 = {k: v.double() for k, v in ins.items()}
    gen = torch.Generator().manual_seed(1)
    ps = shape["p"] + int(bool(opts.get("normalize")))
    gy = torch.randn(shape["b"], shape["l"], shape["h"], shape["p"], generator=gen, dtype=torch.float64)
    gy = gy.to(dtype).double()  # representable in the inputs' dtype: the reference sees the kernels' dy
    gs = torch.randn(shape["b"], shape["h"], ps, shape["n"], generator=gen, dtype=torch.float64)
    yr, sr, gr, _, _ = _run(ssd_reference, ins64, seq, opts, chunk, gy, gs)
    tol = TOL if dtype == torch.float32 else 1e-2
    for unroll in ("1", "2"):
        monkeypatch.setenv("HMSCALE_SSD_WALK_UNROLL", unroll)
        y, s, g, _, _ = _run(_triton, ins, seq, opts, chunk, gy, gs, device=TRITON_DEVICE)
        assert rel(y, yr) < tol, unroll
        assert rel(s, sr) < (TOL if dtype == torch.float32 else 1e-4), unroll
        for k in g:
            assert torch.isfinite(g[k]).all(), k
            assert rel(g[k], gr[k]) < tol, (unroll, k, rel(g[k], gr[k]))


def test_env_backend_and_no_final_state(monkeypatch):
    monkeypatch.setenv("HMSCALE_SSD_BACKEND", "triton")
    ins, seq = make_inputs(1, 24, 2, 1, 16, 16, dtype=torch.float32)
    y = ssd(**on_triton_device(ins)[0], chunk_size=16)
    assert isinstance(y, torch.Tensor)
    yr = ssd_reference(**{k: v.double() for k, v in ins.items()})
    assert rel(y, yr) < TOL


def test_half_precision_inputs():
    # fp16 here: the CPU interpreter (Triton 3.9) computes tl.dot on bf16 operands wrongly (it reads
    # the bits as integers); bf16 is covered on the GPU by benchmarks/ssd_gpu_check.py.
    ins, seq = make_inputs(1, 40, 2, 2, 16, 16, dtype=torch.float16, D=True, seq=True)
    dev_ins, dev_seq = on_triton_device(ins, seq)
    y = ssd(**dev_ins, chunk_size=16, seq_idx=dev_seq, backend="triton")
    yr = ssd_reference(**{k: v.double() for k, v in ins.items()}, seq_idx=seq)
    assert y.dtype == torch.float16
    assert rel(y, yr) < 1e-2


def test_half_precision_normalize_gradients():
    """fp16 inputs with normalize: the normaliser's gradient takes the fp32 (tf32) dot path."""
    ins, seq = make_inputs(1, 40, 2, 1, 16, 32, dtype=torch.float16, D=True, seq=True, init=True, normalize=True)
    opts = dict(normalize=True)
    y, s, g, gy, gs = _run(_triton, ins, seq, opts, 16, device=TRITON_DEVICE)
    yr, sr, gr, _, _ = _run(ssd_reference, {k: v.double() for k, v in ins.items()}, seq, opts, 16, gy, gs)
    assert rel(y, yr) < 1e-2 and rel(s, sr) < 1e-2
    for k in g:
        assert rel(g[k], gr[k]) < 1e-2, k


def test_dbc_tuning_override(monkeypatch):
    """The tuning knob of the dB/dC kernel changes tiles only, not results (P=40 with BP=32: masked tail)."""
    monkeypatch.setenv("HMSCALE_SSD_DBC_CFG", "32,32,2,4")
    ins, seq = make_inputs(1, 37, 2, 1, 40, 48, dtype=torch.float32, seq=True, init=True)
    y, s, g, gy, gs = _run(_triton, ins, seq, {}, 16, device=TRITON_DEVICE)
    yr, sr, gr, _, _ = _run(ssd_reference, {k: v.double() for k, v in ins.items()}, seq, {}, 16, gy, gs)
    for k in g:
        assert rel(g[k], gr[k]) < TOL, k


SMALL_TILES = ("state=16,16,4;dstate=16,16,4;scan=16,16,4;dx=16,16,4;pass=64,4;pass_b=32,4;"
               "fpass=16,16,4,2;fpass_b=16,16,4,2")


@pytest.mark.parametrize("norm,state_pass", [("fused", "split"), ("cat", "split"), ("fused", "fused")])
def test_normalize_many_tiles(norm, state_pass, monkeypatch):
    """normalize with several p and n tiles in every kernel: the normaliser row/column terms are added once
    (fused: by the first p tile's programs), and both normaliser modes agree with the reference; also with the
    fused state passes (HMSCALE_SSD_PASS=fused)."""
    monkeypatch.setenv("HMSCALE_SSD_NORM", norm)
    monkeypatch.setenv("HMSCALE_SSD_PASS", state_pass)
    monkeypatch.setenv("HMSCALE_SSD_TILE_ORDER", "tile" if state_pass == "fused" else "chunk")
    monkeypatch.setenv("HMSCALE_SSD_CFG", SMALL_TILES)
    opts = dict(normalize=True, D=True, init=True, seq=True)
    ins, seq = make_inputs(1, 40, 2, 1, 36, 24, dtype=torch.float32, **opts)
    y, s, g, gy, gs = _run(_triton, ins, seq, opts, 16, device=TRITON_DEVICE)
    yr, sr, gr, _, _ = _run(ssd_reference, {k: v.double() for k, v in ins.items()}, seq, opts, 16, gy, gs)
    assert s.shape == (1, 2, 37, 24)
    assert rel(y, yr) < TOL and rel(s, sr) < TOL
    for k in g:
        assert rel(g[k], gr[k]) < TOL, (k, rel(g[k], gr[k]))


@pytest.mark.parametrize("split,state_pass,norm_bwd,dbc_prec,states", [
    ("state", "split", "rowscale", "bf16", "fp32"), ("all", "split", "rowscale", "bf16x2", "fp32"),
    ("off", "split", "rowscale", "tf32", "fp32"), ("state", "fused", "rowscale", "bf16", "fp32"),
    ("state", "split", "fp32", "bf16x2", "fp32"), ("state", "split", "rowscale", "bf16", "bf16"),
    ("state", "fused", "rowscale", "bf16", "bf16"), ("state", "fused", "rowscale", "bf16", "fp16,fp32"),
    ("state", "split", "rowscale", "bf16", "fp16,fp16"), ("state", "fused", "rowscale", "bf16", "fp16,fp16")])
@pytest.mark.parametrize("opts", [dict(), dict(normalize=True, D=True, init=True, seq=True)])
def test_bf16_state_precision(split, state_pass, norm_bwd, dbc_prec, states, opts, monkeypatch):
    """bf16 inputs: the dots against fp32 states use the bf16 hi/lo split (HMSCALE_SSD_SPLIT; tests/kernels/conftest.py
    makes the interpreter's bf16 dots exact). The state and the decay gradients (dt, A: sums whose terms cancel)
    must stay near fp32 accuracy, far inside the 1e-2 bf16 limit, also when dB/dC rounds the states to bf16
    (HMSCALE_SSD_DBC_PREC=bf16, the default); the rest is bounded by bf16 rounding. With 16-bit state storage
    (HMSCALE_SSD_STATES, opt-in) the final state is still carried in fp32 (1e-4), and dt and A, which sum products of
    the rounded states, stay within 5e-3 here (the rounding alone, emulated in float64, costs them 1e-4 to 2e-3)."""
    monkeypatch.setenv("HMSCALE_SSD_SPLIT", split)
    monkeypatch.setenv("HMSCALE_SSD_DBC_PREC", dbc_prec)
    monkeypatch.setenv("HMSCALE_SSD_PASS", state_pass)
    monkeypatch.setenv("HMSCALE_SSD_STATES", states)
    monkeypatch.setenv("HMSCALE_SSD_NORM_BWD", norm_bwd)  # normalize: dy / den as a row scale, or in fp32
    ins, seq = make_inputs(1, 70, 2, 1, 16, 32, dtype=torch.bfloat16, **opts)
    gen = torch.Generator().manual_seed(1)
    ps = 16 + int(bool(opts))
    # bf16-representable output gradients: the reference then sees the same dy as the kernels
    gy = torch.randn(1, 70, 2, 16, generator=gen, dtype=torch.float64).bfloat16().double()
    gs = torch.randn(1, 2, ps, 32, generator=gen, dtype=torch.float64)
    y, s, g, _, _ = _run(_triton, ins, seq, opts, 32, gy, gs, device=TRITON_DEVICE)
    yr, sr, gr, _, _ = _run(ssd_reference, {k: v.double() for k, v in ins.items()}, seq, opts, 32, gy, gs)
    assert y.dtype == torch.bfloat16
    assert rel(y, yr) < 1e-2
    assert rel(s, sr) < 1e-4
    for k in g:
        assert torch.isfinite(g[k]).all(), k
        assert rel(g[k], gr[k]) < 1e-2, (k, rel(g[k], gr[k]))
    if not opts:
        tol = 1e-4 if states == "fp32" else 5e-3
        assert rel(g["dt"], gr["dt"]) < tol and rel(g["A"], gr["A"]) < tol


@pytest.mark.parametrize("state_pass", ["split", "fused"])
@pytest.mark.parametrize("norm", [False, True])
def test_scaled_fp16_states_hold_the_stored_values(state_pass, norm, monkeypatch):
    """Scaled fp16 storage (HMSCALE_SSD_STATES=fp16,...): the states are fp16 values and one int8 exponent per group of
    a row (the walk's tile width, or 16-64 columns for the split pass); value x 2^exponent is the fp32 storage's state
    to fp16's rounding, the largest of each group in [2^14, 2^15)."""
    from kernels.reference import doc_ids_from_seq_idx
    from kernels.ssd_triton_fwd import ssd_fwd

    monkeypatch.setenv("HMSCALE_SSD_PASS", state_pass)
    opts = dict(normalize=True, init=True, seq=True) if norm else {}
    ins, seq = on_triton_device(*make_inputs(1, 150, 2, 1, 16, 64, dtype=torch.bfloat16, **opts))
    ins["x"] = ins["x"] * 2.0 ** 20  # states past fp16's largest value (65504) unless scaled
    doc = doc_ids_from_seq_idx(seq, 1, 150, seq.device).contiguous() if seq is not None else None
    args = (ins["x"], ins["dt"].float().transpose(1, 2).contiguous(), ins["A"].float(), ins["B"], ins["C"],
            ins["initial_state"].float() if norm else None, doc, 32)
    out = {}
    for storage in ("fp32", "fp16,fp16"):
        monkeypatch.setenv("HMSCALE_SSD_STATES", storage)
        out[storage] = ssd_fwd(*args, norm=norm)
    ref, states, sexp = out["fp32"][4], out["fp16,fp16"][4], out["fp16,fp16"][6]
    assert ref.dtype == torch.float32 and out["fp32"][6].numel() == 0
    assert states.dtype == torch.float16 and sexp.dtype == torch.int8
    gs = states.shape[-1] // sexp.shape[-1]
    assert sexp.shape == (*states.shape[:-1], 64 // gs) and gs in (16, 32, 64)
    got = states.float() * torch.exp2(sexp.float()).repeat_interleave(gs, dim=-1)
    assert torch.isfinite(got).all() and ref.abs().max() > 65504
    assert rel(got, ref) < 1e-3
    top = states.float().abs().view(*sexp.shape, gs).amax(-1)
    assert ((top >= 2.0 ** 14) & (top <= 2.0 ** 15) | (top == 0)).all()
    assert torch.equal(out["fp16,fp16"][0], out["fp32"][0]) or rel(out["fp16,fp16"][0], out["fp32"][0]) < 1e-2


@pytest.mark.parametrize("state_pass", ["split", "fused"])
def test_scaled_fp16_states_are_range_safe(state_pass, monkeypatch):
    """Scaled fp16 storage of the states and state gradients (HMSCALE_SSD_STATES=fp16,fp16): x scaled by 2^14 (states
    far above fp16's largest value) and the output's gradient by 2^-24 (state gradients at fp16's smallest subnormal)
    give outputs and gradients exactly those of the unscaled inputs times the same powers of two: every stored group
    keeps its own exponent, so nothing overflows, underflows or loses bits (unscaled fp16 storage gives inf / 0)."""
    monkeypatch.setenv("HMSCALE_SSD_STATES", "fp16,fp16")
    monkeypatch.setenv("HMSCALE_SSD_PASS", state_pass)
    ins, seq = make_inputs(1, 70, 2, 1, 16, 32, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    gy = torch.randn(1, 70, 2, 16, generator=gen, dtype=torch.float64).bfloat16().double()
    gs = torch.randn(1, 2, 16, 32, generator=gen, dtype=torch.float64)
    kx, ky = 2.0 ** 14, 2.0 ** -24
    y, s, g, _, _ = _run(_triton, ins, seq, {}, 32, gy, gs, device=TRITON_DEVICE)
    y2, s2, g2, _, _ = _run(_triton, dict(ins, x=ins["x"] * kx), seq, {}, 32, gy * ky, gs * ky, device=TRITON_DEVICE)
    assert torch.equal(y2, y * kx) and torch.equal(s2, s * kx)
    scale = dict(x=ky, dt=kx * ky, A=kx * ky, B=kx * ky, C=kx * ky)
    for k in g:
        assert torch.isfinite(g2[k]).all() and g2[k].abs().max() > 0, k
        assert torch.equal(g2[k], g[k] * scale[k]), (k, rel(g2[k], g[k] * scale[k]))


@pytest.mark.parametrize("norm", [False, True])
def test_scaled_fp16_readers_of_two_groups_a_row(norm, monkeypatch):
    """Readers whose n tile spans two scale groups (reader_bn allows 2 GS): 16-column walk tiles store one exponent per
    16 columns, the scan, dx and dB/dC read 32-column tiles. With B's and C's column groups 8x apart (so neighbouring
    groups' exponents differ), every output and gradient matches fp32 storage to fp16 rounding and float64 to the bf16
    limit: a reader that gave a column its neighbour's exponent would be off by 8x there."""
    from kernels.ssd_triton_fwd import reader_bn

    monkeypatch.setenv("HMSCALE_SSD_PASS", "fused")
    monkeypatch.setenv("HMSCALE_SSD_CFG", "fpass=16,16;fpass_b=16,16")
    assert reader_bn(64, 16) == 32
    opts = dict(normalize=True, D=True, init=True, seq=True) if norm else dict(D=True)
    ins, seq = make_inputs(1, 90, 2, 2, 16, 64, dtype=torch.bfloat16, **opts)
    colscale = 8.0 ** (torch.arange(64) // 16).double()
    ins["B"] = (ins["B"].double() * colscale).bfloat16()  # (positive with normalize: the normaliser stays > 0)
    ins["C"] = (ins["C"].double() / colscale).bfloat16()
    gen = torch.Generator().manual_seed(1)
    gy = torch.randn(1, 90, 2, 16, generator=gen, dtype=torch.float64).bfloat16().double()
    gs = torch.randn(1, 2, 16 + int(norm), 64, generator=gen, dtype=torch.float64)
    out = {}
    for storage in ("fp32", "fp16,fp16"):
        monkeypatch.setenv("HMSCALE_SSD_STATES", storage)
        out[storage] = _run(_triton, ins, seq, opts, 16, gy, gs, device=TRITON_DEVICE)
    yr, sr, gr, _, _ = _run(ssd_reference, {k: v.double() for k, v in ins.items()}, seq, opts, 16, gy, gs)
    (y, s, g, _, _), (y32, s32, g32, _, _) = out["fp16,fp16"], out["fp32"]
    assert rel(y, y32) < 5e-3 and rel(s, s32) < 1e-6  # the final state is carried in fp32 registers
    assert rel(y, yr) < 1e-2
    for k in g:
        assert torch.isfinite(g[k]).all(), k
        assert rel(g[k], g32[k]) < 5e-3, (k, rel(g[k], g32[k]))
        assert rel(g[k], gr[k]) < 1e-2, (k, rel(g[k], gr[k]))


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("walk_tile", ["16,16", "16,32", "16,64"])
def test_scaled_fp16_exponent_words_give_the_byte_results(norm, walk_tile, monkeypatch):
    """HMSCALE_SSD_EXP_LOAD=word: the readers load the int8 exponents as the int32 words holding them (what lets
    Triton's pipeliner stage those loads): outputs and every gradient bitwise those of byte loads (on a GPU within 1e-6:
    the compiled kernels may round a sum differently), with readers of two
    scale groups a tile row (16- and 32-column walk tiles: both from one word) and of one (64), exponents of both signs
    (x scaled up, the output gradient down); a bad value is refused."""
    from kernels.ssd_triton_fwd import exponent_load_mode, exponent_words, ssd_fwd

    monkeypatch.setenv("HMSCALE_SSD_PASS", "fused")
    monkeypatch.setenv("HMSCALE_SSD_CFG", f"fpass={walk_tile};fpass_b={walk_tile}")
    monkeypatch.setenv("HMSCALE_SSD_STATES", "fp16,fp16")
    opts = dict(normalize=True, D=True, init=True, seq=True) if norm else dict(D=True)
    ins, seq = make_inputs(1, 90, 2, 2, 16, 64, dtype=torch.bfloat16, **opts)
    ins["x"] = ins["x"] * 2.0 ** 18  # states past fp16's range: positive exponents
    gen = torch.Generator().manual_seed(2)
    gy = torch.randn(1, 90, 2, 16, generator=gen, dtype=torch.float64).bfloat16().double() * 2.0 ** -30
    gs = torch.randn(1, 2, 16 + int(norm), 64, generator=gen, dtype=torch.float64) * 2.0 ** -30  # negative ones
    out = {}
    for mode in ("byte", "word"):
        monkeypatch.setenv("HMSCALE_SSD_EXP_LOAD", mode)
        assert exponent_load_mode() == mode
        out[mode] = _run(_triton, ins, seq, opts, 16, gy, gs, device=TRITON_DEVICE)
    fwd_in = (ins["x"], ins["dt"].float().transpose(1, 2).contiguous(), ins["A"].float(), ins["B"], ins["C"])
    exps = ssd_fwd(*(v.to(TRITON_DEVICE) for v in fwd_in), None, None, 16, norm=False)[6]
    words = exponent_words(exps)
    assert exps.dtype == torch.int8 and exps.abs().max() > 0 and words.dtype == torch.int32
    assert torch.equal(words.view(torch.int8)[:exps.numel()], exps.flatten())  # the same bytes, little-endian words
    (yb, sb, gb, _, _), (yw, sw, gw, _, _) = out["byte"], out["word"]
    assert torch.equal(yb, yw) and torch.equal(sb, sw)
    for k in gb:  # compiled for a GPU the two forms may round a sum differently (H200: dt's gradient, ~1 ulp)
        assert torch.isfinite(gb[k]).all(), k
        if TRITON_DEVICE == "cpu":
            assert torch.equal(gb[k], gw[k]), k
        else:
            assert rel(gw[k], gb[k]) < 1e-6, (k, rel(gw[k], gb[k]))
    odd = torch.zeros(2, 3, dtype=torch.int8)  # three groups a row: a row's two groups may straddle words
    assert exponent_words(odd) is odd
    monkeypatch.setenv("HMSCALE_SSD_EXP_LOAD", "int32")
    with pytest.raises(ValueError, match="HMSCALE_SSD_EXP_LOAD must be byte or word"):
        exponent_load_mode()


def _core_leaf(ins, k):
    """A leaf input of the core ops (``core_fwd_op``): as ``ssd`` passes it, dt heads-major (b, h, l)."""
    return (ins[k].transpose(1, 2).contiguous() if k == "dt" else ins[k]).clone().requires_grad_()


@pytest.mark.parametrize("opts", [dict(), dict(normalize=True, D=True, init=True, seq=True)])
def test_custom_ops_pass_opcheck(opts):
    """The core as torch.library custom ops (what a torch.compile graph holds): schema, fake shapes and dtypes,
    autograd registration and AOT dispatch agree with the real kernels (torch.library.opcheck)."""
    from kernels.reference import doc_ids_from_seq_idx
    from kernels.ssd_autograd import _d_hp, core_fwd_op

    ins, seq = on_triton_device(*make_inputs(1, 40, 2, 1, 16, 16, dtype=torch.float32, **opts))
    norm = opts.get("normalize", False)
    doc = doc_ids_from_seq_idx(seq, 1, 40, seq.device).contiguous() if seq is not None else None
    Dhp = _d_hp(ins["D"], 2, 16) if "D" in ins else None
    leaves = [_core_leaf(ins, k) for k in ("x", "dt", "A", "B", "C")]  # the core takes dt heads-major
    init = ins["initial_state"].clone().requires_grad_() if "initial_state" in ins else None
    args = (*leaves, init, doc, 16, torch.float32, norm, Dhp, True)
    torch.library.opcheck(core_fwd_op, args)


def test_custom_op_with_an_unused_final_state_reads_no_final_gradient(monkeypatch):
    """In training the final state is unused: as in the eager Function, its gradient reaches the compiled graph's
    backward op as None (no zeros allocated, filled and read by the backward walk); a used one as its values."""
    import kernels.ssd_autograd as sa

    seen = []
    real = sa._core_backward
    monkeypatch.setattr(sa, "_core_backward", lambda dy, dfinal, *a: seen.append(dfinal) or real(dy, dfinal, *a))
    ins, _ = on_triton_device(*make_inputs(1, 40, 2, 1, 16, 16, dtype=torch.float32))
    leaves = [_core_leaf(ins, k) for k in ("x", "dt", "A", "B", "C")]  # the core takes dt heads-major
    y, final = sa.core_fwd_op(*leaves, None, None, 16, torch.float32, False, None, True)[:2]
    torch.autograd.grad(y.sum(), leaves, retain_graph=True)
    assert seen == [None]
    torch.autograd.grad((y.sum() + final.sum()), leaves)
    assert seen[1] is not None and torch.equal(seen[1], torch.ones_like(final))


def test_dt_reaches_the_kernels_heads_major_and_a_heads_major_dt_is_not_copied(monkeypatch):
    """The kernels read dt as (b, h, l): ``ssd`` transposes a (b, l, h) dt once, and hands a dt already stored
    heads-major (a transposed view) over without a copy; both give the same outputs and gradients, ddt in dt's
    shape."""
    import kernels.ssd_autograd as sa

    seen = []
    real = sa._core_forward
    monkeypatch.setattr(sa, "_core_forward", lambda x, dt, *a: seen.append(dt) or real(x, dt, *a))
    ins, _ = on_triton_device(*make_inputs(2, 40, 3, 1, 16, 16, dtype=torch.float32))
    outs = []
    for heads_major in (False, True):
        dt = ins["dt"].transpose(1, 2).contiguous().transpose(1, 2) if heads_major else ins["dt"].clone()
        dt.requires_grad_()
        y = _triton(x=ins["x"], dt=dt, A=ins["A"], B=ins["B"], C=ins["C"], chunk_size=16)
        (ddt,) = torch.autograd.grad((y * y).sum(), [dt])
        assert seen[-1].shape == (2, 3, 40) and seen[-1].is_contiguous()
        assert (seen[-1].data_ptr() == dt.data_ptr()) == heads_major  # copied only when stored (b, l, h)
        assert ddt.shape == dt.shape == (2, 40, 3)
        outs.append((y, ddt))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_state_pass_mode_choice(monkeypatch):
    """HMSCALE_SSD_PASS=auto: fused passes when the (batch x head x state tile) programs occupy at least 7/8 of the
    GPU's multiprocessors, split ones for long single sequences of smaller states; explicit modes win; a bad value is
    refused."""
    from kernels import ssd_triton_fwd as fwd

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fwd, "_sm_count", lambda device: 132 if device.type == "cuda" else None)
    monkeypatch.delenv("HMSCALE_SSD_PASS", raising=False)
    monkeypatch.delenv("HMSCALE_SSD_CFG", raising=False)
    bf16 = torch.bfloat16
    # 1.4b shape (P=128, N=256: 8 tiles of 64 x 64): b=1 gives 128 programs (>= 7/8 of 132), b=8 gives 1024
    assert fwd.use_fused_pass(1, 16, 128, 256, bf16, cuda, "fpass")
    assert fwd.use_fused_pass(8, 16, 128, 256, bf16, cuda, "fpass_b")
    # 12 such heads: 96 programs (< 115.5); the 410m shape at b=1 (P=64, N=128: 2 tiles): 32 programs
    assert not fwd.use_fused_pass(1, 12, 128, 256, bf16, cuda, "fpass")
    assert not fwd.use_fused_pass(1, 16, 64, 128, bf16, cuda, "fpass_b")
    assert fwd.use_fused_pass(4, 16, 64, 128, bf16, cuda, "fpass")  # 128 programs
    assert not fwd.use_fused_pass(8, 16, 128, 256, bf16, torch.device("cpu"), "fpass")  # interpreter: split
    monkeypatch.setenv("HMSCALE_SSD_PASS", "fused")
    assert fwd.use_fused_pass(1, 16, 128, 256, bf16, cuda, "fpass")
    monkeypatch.setenv("HMSCALE_SSD_PASS", "split")
    assert not fwd.use_fused_pass(8, 16, 128, 256, bf16, cuda, "fpass")
    monkeypatch.setenv("HMSCALE_SSD_PASS", "fast")
    with pytest.raises(ValueError, match="HMSCALE_SSD_PASS must be"):
        fwd.use_fused_pass(8, 16, 128, 256, bf16, cuda, "fpass")


def test_fused_pass_tile_and_unroll(monkeypatch):
    """The fused passes' tile: the default (its own for heads of 128+ channels), except that its BN halves while
    twice the programs still fit in one round (two 4-warp walks or one 8-warp walk per multiprocessor; not for a tile
    set through HMSCALE_SSD_CFG, nor on the CPU); the walks' unroll is 2 for bf16 inputs, 1 for the others, unless
    HMSCALE_SSD_WALK_UNROLL says otherwise; anything but 1 or 2 is a one-line error. The fused-or-split rule still
    counts 64 x 64 tiles (test_state_pass_mode_choice)."""
    from kernels import ssd_triton_fwd as fwd

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fwd, "_sm_count", lambda device: 132 if device.type == "cuda" else None)
    monkeypatch.delenv("HMSCALE_SSD_CFG", raising=False)
    monkeypatch.delenv("HMSCALE_SSD_WALK_UNROLL", raising=False)
    bf16 = torch.bfloat16
    cfg = fwd.fused_pass_config
    # 1.4b (P = 128: the wide heads' 128 x 64 tile, 8 warps): b=1 64 programs -> 128; b=2 128 programs (one round
    # already) and b=8 512 programs keep it
    assert cfg(128, 256, bf16, "fpass", 64, 16, cuda) == (128, 32, 8, 3)
    assert cfg(128, 256, bf16, "fpass", 64, 2 * 16, cuda) == (128, 64, 8, 3)
    assert cfg(128, 256, bf16, "fpass", 64, 2 * 16 - 1, cuda) == (128, 64, 8, 3)  # 124 programs
    assert cfg(128, 256, bf16, "fpass", 64, 16 + 1, cuda) == (128, 64, 8, 3)  # 68 programs: 136 would not fit
    assert cfg(128, 256, bf16, "fpass_b", 64, 8 * 16, cuda) == (128, 64, 8, 3)
    assert cfg(128, 256, bf16, "fpass_b", 64, 16, cuda) == (64, 32, 4, 3)  # the backward walk halves its rows too
    assert cfg(128, 256, bf16, "fpass_b", 64, 2 * 16, cuda) == (128, 64, 8, 3)
    assert cfg(128, 256, bf16, "fpass", 64, 16, torch.device("cpu"))[:2] == (128, 64)
    assert cfg(128, 256, bf16, "fpass")[:2] == (128, 64)  # no device: the default
    assert cfg(64, 128, bf16, "fpass", 64, 16, cuda)[:2] == (64, 32)  # 410m, b=1: 32 programs -> 64
    assert cfg(64, 128, bf16, "fpass", 64, 65, cuda)[:2] == (64, 32)  # 4 warps: 130 programs -> 260 (two a SM)
    assert cfg(64, 128, bf16, "fpass", 64, 66, cuda)[:2] == (64, 64)  # 132 programs fill the SMs
    assert cfg(64, 128, bf16, "fpass", 64, 8 * 16, cuda)[:2] == (64, 64)
    assert cfg(64, 16, bf16, "fpass", 64, 1, cuda)[:2] == (64, 16)  # no halving below BN 32
    assert cfg(128, 256, torch.float32, "fpass")[:2] == (32, 64)  # fp32 inputs keep their own tile
    monkeypatch.setenv("HMSCALE_SSD_CFG", "fpass=64,64")
    assert cfg(128, 256, bf16, "fpass", 64, 16, cuda)[:2] == (64, 64)
    assert cfg(128, 256, bf16, "fpass_b", 64, 16, cuda)[:2] == (64, 32)
    monkeypatch.setenv("HMSCALE_SSD_CFG", "fpass_b=128,64,8,3")
    assert cfg(128, 256, bf16, "fpass_b", 64, 16, cuda) == (128, 64, 8, 3)  # a tile set by hand is kept
    assert fwd.walk_unroll(bf16) == 2 and fwd.walk_unroll(torch.float16) == fwd.walk_unroll(torch.float32) == 1
    monkeypatch.setenv("HMSCALE_SSD_WALK_UNROLL", "1")
    assert fwd.walk_unroll(bf16) == 1
    monkeypatch.setenv("HMSCALE_SSD_WALK_UNROLL", "2")
    assert fwd.walk_unroll(torch.float32) == 2
    monkeypatch.setenv("HMSCALE_SSD_WALK_UNROLL", "4")
    with pytest.raises(ValueError, match="HMSCALE_SSD_WALK_UNROLL must be 1 or 2"):
        fwd.walk_unroll()


def test_tile_order_choice(monkeypatch):
    """HMSCALE_SSD_TILE_ORDER=auto: dx in tile order always, dB/dC from 4 n tiles on; explicit values win."""
    from kernels.ssd_triton_bwd import tile_major

    monkeypatch.delenv("HMSCALE_SSD_TILE_ORDER", raising=False)
    assert tile_major("dx", 1) and tile_major("dx", 4)
    assert not tile_major("dbc", 2) and tile_major("dbc", 4)
    monkeypatch.setenv("HMSCALE_SSD_TILE_ORDER", "chunk")
    assert not tile_major("dx", 4) and not tile_major("dbc", 4)
    monkeypatch.setenv("HMSCALE_SSD_TILE_ORDER", "tile")
    assert tile_major("dbc", 2)
    monkeypatch.setenv("HMSCALE_SSD_TILE_ORDER", "sideways")
    with pytest.raises(ValueError, match="HMSCALE_SSD_TILE_ORDER must be"):
        tile_major("dx", 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opts", [dict(), dict(normalize=True, D=True, init=True, seq=True), dict(D=True, seq=True)])
def test_fused_dx_dbc_kernel(dtype, opts, monkeypatch):
    """dx and dB/dC in one kernel (HMSCALE_SSD_BWD_FUSE=1, P not a power of two, several n tiles): it runs, and every
    output and gradient stays within the 16-bit limit of float64; the decay gradients (dt, A) near fp32 accuracy."""
    import kernels.ssd_triton_bwd as bwd

    launches = []
    orig = bwd._chunk_bwd_fused.run
    monkeypatch.setattr(bwd._chunk_bwd_fused, "run", lambda *a, **k: launches.append(1) or orig(*a, **k))
    monkeypatch.setenv("HMSCALE_SSD_BWD_FUSE", "1")
    monkeypatch.setenv("HMSCALE_SSD_CFG", "fbwd=16,4,2")
    ins, seq = make_inputs(1, 70, 2, 2, 24, 40, dtype=dtype, **opts)
    norm = bool(opts.get("normalize"))
    gen = torch.Generator().manual_seed(1)
    gy = torch.randn(1, 70, 2, 24, generator=gen, dtype=torch.float64).to(dtype).double()
    gs = torch.randn(1, 2, 24 + int(norm), 40, generator=gen, dtype=torch.float64)
    y, s, g, _, _ = _run(_triton, ins, seq, opts, 16, gy, gs, device=TRITON_DEVICE)
    yr, sr, gr, _, _ = _run(ssd_reference, {k: v.double() for k, v in ins.items()}, seq, opts, 16, gy, gs)
    assert launches, "the fused backward kernel did not run"
    assert rel(y, yr) < 1e-2 and rel(s, sr) < 1e-4
    for k in g:
        assert torch.isfinite(g[k]).all(), k
        assert rel(g[k], gr[k]) < 1e-2, (k, rel(g[k], gr[k]))
    assert rel(g["dt"], gr["dt"]) < 1e-4 and rel(g["A"], gr["A"]) < 1e-4


def test_fused_dx_dbc_choice(monkeypatch):
    """auto: the fused backward for one head per group, P <= 64, no normaliser, 16-bit, saved numerator; 1 also at
    P <= 128 and with the normaliser; 0 never; a bad value names the variable."""
    from kernels.ssd_triton_bwd import use_fused_bwd

    bf16 = torch.bfloat16
    monkeypatch.delenv("HMSCALE_SSD_BWD_FUSE", raising=False)
    assert use_fused_bwd(16, 16, 64, bf16, 64, True, False)
    assert not use_fused_bwd(16, 16, 64, bf16, 64, True, True)  # normaliser
    assert not use_fused_bwd(16, 16, 128, bf16, 64, True, False)  # P = 128
    assert not use_fused_bwd(1, 16, 64, bf16, 64, True, False)  # shared B/C
    assert not use_fused_bwd(16, 16, 64, torch.float32, 64, True, False)
    assert not use_fused_bwd(16, 16, 64, bf16, 64, False, False)  # numerator not kept
    assert not use_fused_bwd(16, 16, 64, bf16, 128, True, False)  # chunk 128
    monkeypatch.setenv("HMSCALE_SSD_BWD_FUSE", "1")
    assert use_fused_bwd(16, 16, 128, bf16, 64, True, True) and not use_fused_bwd(16, 16, 256, bf16, 64, True, False)
    monkeypatch.setenv("HMSCALE_SSD_BWD_FUSE", "0")
    assert not use_fused_bwd(16, 16, 64, bf16, 64, True, False)
    monkeypatch.setenv("HMSCALE_SSD_BWD_FUSE", "yes")
    with pytest.raises(ValueError, match="HMSCALE_SSD_BWD_FUSE must be"):
        use_fused_bwd(16, 16, 64, bf16, 64, True, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[0], CASES[4], (dict(b=2, l=45, h=2, g=2, p=72, n=40), 16,
                                                      dict(D=True, init=True, seq=True))])
def test_bwd_pair_launch(case, dtype, monkeypatch):
    """dB/dC and dx interleaved in one launch (HMSCALE_SSD_BWD_PAIR=1; several p and n tiles, P not a power of two,
    the normaliser, D, seq_idx, initial state): the same kernels' code on the same tiles, so under the interpreter
    every gradient equals the two-launch backward's bitwise (on a GPU within rounding), and stays within the dtype's
    limit of float64."""
    import kernels.ssd_triton_bwd as bwd

    shape, chunk, opts = case
    launches = []
    orig = bwd._chunk_bwd_pair.run
    monkeypatch.setattr(bwd._chunk_bwd_pair, "run", lambda *a, **k: launches.append(1) or orig(*a, **k))
    monkeypatch.setenv("HMSCALE_SSD_BWD_FUSE", "0")
    monkeypatch.setenv("HMSCALE_SSD_CFG", "dx=16,16,4;pair=16,16,4")  # several p, n tiles of dx, the same both ways
    monkeypatch.setenv("HMSCALE_SSD_DBC_CFG", "16,16,2,4")  # several n tiles and p steps of dB/dC
    ins, seq = make_inputs(**shape, **opts, dtype=dtype)
    monkeypatch.setenv("HMSCALE_SSD_BWD_PAIR", "0")
    y0, s0, g0, gy, gs = _run(_triton, ins, seq, opts, chunk, device=TRITON_DEVICE)
    assert not launches
    monkeypatch.setenv("HMSCALE_SSD_BWD_PAIR", "1")
    y, s, g, _, _ = _run(_triton, ins, seq, opts, chunk, gy, gs, device=TRITON_DEVICE)
    assert launches, "the paired backward did not run"
    yr, sr, gr, _, _ = _run(ssd_reference, {k: v.double() for k, v in ins.items()}, seq, opts, chunk, gy, gs)
    tol = TOL if dtype == torch.float32 else 1e-2
    report = {k: (rel(g[k], g0[k]), rel(g[k], gr[k]), rel(g0[k], gr[k])) for k in g}  # pair vs two, vs ref
    for k in g:
        assert torch.isfinite(g[k]).all(), k
        assert rel(g[k], gr[k]) < tol, (k, report)
    assert torch.equal(y, y0) and torch.equal(s, s0)
    if TRITON_DEVICE == "cpu":  # the interpreter runs the same operations in the same order
        for k in g:
            assert torch.equal(g[k], g0[k]), (k, report)
    else:  # the GPU compiler may schedule one kernel's sums differently from the other's (different registers)
        for k in g:
            assert rel(g[k], g0[k]) < (1e-6 if dtype == torch.float32 else 1e-3), (k, report)


def test_bwd_pair_choice(monkeypatch):
    """auto: the paired launch for bf16 heads of 64+ channels with one head per group; 1 wherever one head per
    group; 0 never; a bad value names the variable. Its tiles and cap: dx 64 x 32 under 168 registers for heads of
    128+ channels, 64 x 64 uncapped below."""
    from kernels.ssd_triton_bwd import use_bwd_pair
    from kernels.ssd_triton_fwd import kcfg, register_cap

    bf16 = torch.bfloat16
    monkeypatch.delenv("HMSCALE_SSD_BWD_PAIR", raising=False)
    assert use_bwd_pair(128, True, bf16) and use_bwd_pair(80 + 48, True, bf16)
    assert not use_bwd_pair(128, True, torch.float16)  # not timed
    assert use_bwd_pair(64, True, bf16) and not use_bwd_pair(32, True, bf16)
    assert not use_bwd_pair(128, False, bf16)  # shared B/C: dB/dC's general form
    assert not use_bwd_pair(128, True, torch.float32)
    monkeypatch.setenv("HMSCALE_SSD_BWD_PAIR", "1")
    assert use_bwd_pair(64, True, torch.float32) and not use_bwd_pair(64, False, bf16)
    monkeypatch.setenv("HMSCALE_SSD_BWD_PAIR", "0")
    assert not use_bwd_pair(128, True, bf16)
    monkeypatch.setenv("HMSCALE_SSD_BWD_PAIR", "both")
    with pytest.raises(ValueError, match="HMSCALE_SSD_BWD_PAIR must be"):
        use_bwd_pair(128, True, bf16)
    monkeypatch.delenv("HMSCALE_SSD_CFG", raising=False)
    monkeypatch.delenv("HMSCALE_SSD_MAXNREG", raising=False)
    assert kcfg("pair", bf16, 64, 128) == (64, 32, 4, 3) and register_cap("pair", bf16, 64, 128) == {"maxnreg": 168}
    assert kcfg("pair", bf16, 64, 64) == (64, 64, 4, 3) and register_cap("pair", bf16, 64, 64) == {}


def test_dbc_state_precision_choice(monkeypatch):
    """dB/dC's state dots: one bf16 dot for bf16 inputs by default, the env choice for bf16 only, tf32 for fp16,
    exact for fp32; a bad value names the variable."""
    from kernels.ssd_triton_fwd import dbc_state_precision

    monkeypatch.delenv("HMSCALE_SSD_DBC_PREC", raising=False)
    assert dbc_state_precision(torch.bfloat16) == "bf16"
    assert dbc_state_precision(torch.float16) == "tf32"
    assert dbc_state_precision(torch.float32) == "ieee"
    monkeypatch.setenv("HMSCALE_SSD_DBC_PREC", "bf16x2")
    assert dbc_state_precision(torch.bfloat16) == "bf16x2" and dbc_state_precision(torch.float32) == "ieee"
    monkeypatch.setenv("HMSCALE_SSD_DBC_PREC", "fp8")
    with pytest.raises(ValueError, match="HMSCALE_SSD_DBC_PREC must be"):
        dbc_state_precision(torch.bfloat16)


@pytest.mark.parametrize("chunk", [32, 128])
@pytest.mark.parametrize("opts", [dict(seq=True), dict(normalize=True, D=True, init=True, seq=True)])
def test_bf16_one_head_per_group(chunk, opts, monkeypatch):
    """One head per B/C group (HedgeMamba) in bf16: the dB/dC kernel's one-head form (HMSCALE_SSD_DBC_ONE_HEAD=1,
    the default) gives the general form's dB and dC up to fp32 summation order, every other gradient bit for bit,
    and both agree with the float64 reference; chunk 128 takes its own (8-warp) tilings. l = 150: several chunks
    and a partial last one."""
    ins, seq = make_inputs(1, 150, 2, 2, 16, 32, dtype=torch.bfloat16, **opts)
    gen = torch.Generator().manual_seed(1)
    ps = 16 + int(bool(opts.get("normalize")))
    gy = torch.randn(1, 150, 2, 16, generator=gen, dtype=torch.float64).bfloat16().double()
    gs = torch.randn(1, 2, ps, 32, generator=gen, dtype=torch.float64)
    grads = {}
    for one_head in ("1", "0"):
        monkeypatch.setenv("HMSCALE_SSD_DBC_ONE_HEAD", one_head)
        y, s, grads[one_head], _, _ = _run(_triton, ins, seq, opts, chunk, gy, gs, device=TRITON_DEVICE)
    yr, sr, gr, _, _ = _run(ssd_reference, {k: v.double() for k, v in ins.items()}, seq, opts, chunk, gy, gs)
    assert rel(y, yr) < 1e-2 and rel(s, sr) < 1e-4
    one, general = grads["1"], grads["0"]
    for k in one:
        assert torch.isfinite(one[k]).all(), k
        if k in ("B", "C"):
            assert rel(one[k], general[k]) < 1e-3, (k, rel(one[k], general[k]))
            assert rel(one[k], gr[k]) < 1e-2, (k, rel(one[k], gr[k]))
        else:
            assert torch.equal(one[k], general[k]), k
    assert rel(one["x"], gr["x"]) < 1e-2


def test_launch_configs_by_chunk(monkeypatch):
    """16-bit inputs at chunk 128 take the 8-warp tilings (spill-free for sm_90: benchmarks/ssd_registers.py);
    chunk 64 and fp32 inputs keep theirs; HMSCALE_SSD_CFG / HMSCALE_SSD_DBC_CFG still override."""
    from kernels.ssd_triton_bwd import dbc_config
    from kernels.ssd_triton_fwd import DEFAULT_CFG, DEFAULT_CFG_FP32, DEFAULT_CFG_Q128, DEFAULT_CFG_WIDE, kcfg

    monkeypatch.delenv("HMSCALE_SSD_CFG", raising=False)
    monkeypatch.delenv("HMSCALE_SSD_DBC_CFG", raising=False)
    bf16 = torch.bfloat16
    assert kcfg("dx", bf16, 128) == DEFAULT_CFG_Q128["dx"] != DEFAULT_CFG["dx"] == kcfg("dx", bf16, 64)
    assert kcfg("state", bf16, 128) == DEFAULT_CFG["state"]  # no Q x Q tile: unchanged
    assert kcfg("scan", torch.float32, 128) == DEFAULT_CFG_FP32["scan"]
    assert dbc_config(256, bf16, 128) == (16, 32, 3, 8) and dbc_config(256, bf16, 64) == (32, 64, 3, 4)
    # heads whose tile is 128+ channels (P = 80 too): the scan's own default at chunk 64 (16-bit only); P = 64 not
    assert kcfg("scan", bf16, 64, 128) == kcfg("scan", bf16, 64, 80) == DEFAULT_CFG_WIDE["scan"]
    assert DEFAULT_CFG_WIDE["scan"] != DEFAULT_CFG["scan"] == kcfg("scan", bf16, 64, 64)
    assert kcfg("scan", torch.float32, 64, 256) == DEFAULT_CFG_FP32["scan"]
    assert kcfg("dx", bf16, 64, 256) == DEFAULT_CFG["dx"]
    monkeypatch.setenv("HMSCALE_SSD_CFG", "dx=32,32,4;scan=64,64")
    assert kcfg("dx", bf16, 128) == (32, 32, 4, 0)
    assert kcfg("scan", bf16, 64, 128) == (64, 64) + DEFAULT_CFG_WIDE["scan"][2:]


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_numerator_or_recomputed(case, dtype, monkeypatch):
    """HMSCALE_SSD_SAVE_Y: dx reads the forward's fp32 numerator (1, default) or recomputes it from the entering
    states (0); both match the reference (fp32: 1e-5; bf16: the decay gradients dt, A within 1e-4, the rest 1e-2),
    and the two agree with each other to fp32 rounding."""
    shape, chunk, opts = case
    ins, seq = make_inputs(**shape, **opts, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    ps = shape["p"] + int(bool(opts.get("normalize")))
    gy = torch.randn(shape["b"], shape["l"], shape["h"], shape["p"], generator=gen, dtype=torch.float64)
    gy = gy.to(dtype).double()
    gs = torch.randn(shape["b"], shape["h"], ps, shape["n"], generator=gen, dtype=torch.float64)
    out = {}
    for save in ("1", "0"):
        monkeypatch.setenv("HMSCALE_SSD_SAVE_Y", save)
        out[save] = _run(_triton, ins, seq, opts, chunk, gy, gs, device=TRITON_DEVICE)[2]
    gr = _run(ssd_reference, {k: v.double() for k, v in ins.items()}, seq, opts, chunk, gy, gs)[2]
    for k in gr:
        assert rel(out["1"][k], out["0"][k]) < 1e-5, (k, rel(out["1"][k], out["0"][k]))
        if dtype == torch.float32:
            tol = TOL
        else:
            tol = 1e-4 if k in ("dt", "A") and not opts.get("normalize") else 1e-2
        for save in out:
            assert rel(out[save][k], gr[k]) < tol, (save, k, rel(out[save][k], gr[k]))


def test_state_storage_setting(monkeypatch):
    """HMSCALE_SSD_STATES: auto by default (fp16 S and dS for bf16 inputs, scaled); S[,dS] for bf16 inputs (dS
    follows a bf16 S, else fp32); fp16 and fp32 inputs keep fp32 whatever it says; an unknown name is a one-line error
    naming the variable."""
    from kernels.ssd_triton_fwd import state_dtype, state_storage

    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    monkeypatch.delenv("HMSCALE_SSD_STATES", raising=False)
    assert state_dtype(bf16) == f16 and state_dtype(bf16, grad=True) == f16 and state_storage()[2]
    assert state_dtype(f16) == f32 and state_dtype(torch.float32, grad=True) == f32
    monkeypatch.setenv("HMSCALE_SSD_STATES", "fp32")
    assert state_dtype(bf16) == f32 and state_dtype(bf16, grad=True) == f32 and not state_storage()[2]
    monkeypatch.setenv("HMSCALE_SSD_STATES", "bf16")
    assert state_dtype(bf16) == bf16 and state_dtype(bf16, grad=True) == bf16
    assert state_dtype(f16) == f32 and state_dtype(f32, grad=True) == f32
    monkeypatch.setenv("HMSCALE_SSD_STATES", "fp16")
    assert state_dtype(bf16) == f16 and state_dtype(bf16, grad=True) == f32
    monkeypatch.setenv("HMSCALE_SSD_STATES", "bf16,fp32")
    assert state_dtype(bf16) == bf16 and state_dtype(bf16, grad=True) == f32
    monkeypatch.setenv("HMSCALE_SSD_STATES", "fp16,fp16")
    assert state_dtype(bf16) == f16 and state_dtype(bf16, grad=True) == f16
    for bad in ("fp16,fp8", "fp8", "bf16,bf16,bf16"):
        monkeypatch.setenv("HMSCALE_SSD_STATES", bad)
        with pytest.raises(ValueError, match="HMSCALE_SSD_STATES must be"):
            state_dtype(bf16)


def test_state_layout_scale_groups(monkeypatch):
    """Where scaled fp16 storage applies: its group is the fused walk's tile width (it must divide N) or, for the
    split pass, the widest of 64 / 32 / 16 dividing N; no group: fp32. ``auto`` keeps fp16 only for groups of 32+
    columns (a reader's tile spans at most two groups), an explicit fp16 takes any group; the v1 backward stores
    fp32; the readers' n tiles never span more than two groups (reader_bn)."""
    from kernels.ssd_triton_fwd import reader_bn, scale_group, state_layout

    assert scale_group(256, 32) == 32 and scale_group(80, 64) == 0 and scale_group(128, None) == 64
    assert scale_group(96, None) == 32 and scale_group(80, None) == 16 and scale_group(40, None) == 0
    assert reader_bn(64, 32, 0) == 64 and reader_bn(32, 0, 0) == 32 and reader_bn(64, 64, 16) == 32
    assert reader_bn(128, 32) == 64 and reader_bn(16, 64) == 16
    bf16, cpu = torch.bfloat16, torch.device("cpu")  # the CPU: the split passes
    monkeypatch.setenv("HMSCALE_SSD_PASS", "split")
    monkeypatch.delenv("HMSCALE_SSD_STATES", raising=False)
    assert state_layout(2, 4, 64, 128, bf16, cpu)[:2] == (torch.float16, 64)
    assert state_layout(2, 4, 64, 32, bf16, cpu)[:2] == (torch.float16, 32)
    assert state_layout(2, 4, 64, 16, bf16, cpu)[:2] == (torch.float32, 0)  # auto: a 16-column group
    assert state_layout(2, 4, 64, 128, torch.float32, cpu)[:2] == (torch.float32, 0)
    monkeypatch.setenv("HMSCALE_SSD_STATES", "fp16,fp16")
    assert state_layout(2, 4, 64, 32, bf16, cpu, grad=True)[:2] == (torch.float16, 32)
    assert state_layout(2, 4, 64, 40, bf16, cpu)[:2] == (torch.float32, 0)
    monkeypatch.setenv("HMSCALE_SSD_PASS", "fused")
    monkeypatch.setenv("HMSCALE_SSD_CFG", "fpass=64,16")
    assert state_layout(2, 4, 64, 128, bf16, cpu)[:3] == (torch.float16, 16, (64, 16, 4, 3))
    monkeypatch.setenv("HMSCALE_SSD_BWD", "v1")
    assert state_layout(2, 4, 64, 128, bf16, cpu)[:2] == (torch.float32, 0)


def test_register_caps(monkeypatch):
    """Triton's maxnreg per kernel, for 16-bit inputs at chunk 64: dB/dC and the scan capped at 168 registers (3
    blocks per multiprocessor instead of 2), not the wide heads' scan; nothing for fp32, other chunks or other
    kernels. HMSCALE_SSD_MAXNREG overrides by kernel name (0 removes a cap); a malformed entry is a one-line error
    naming the variable."""
    from kernels import ssd_triton_fwd as fwd

    bf16 = torch.bfloat16
    monkeypatch.delenv("HMSCALE_SSD_MAXNREG", raising=False)
    cap = fwd.register_cap
    assert cap("dbc", bf16) == cap("dbc", torch.float16) == cap("scan", bf16, 64, 64) == {"maxnreg": 168}
    assert cap("dbc", torch.float32) == cap("dbc", bf16, 128) == cap("dx", bf16) == {}
    assert cap("scan", bf16, 64, 128) == cap("scan", bf16, 64, 80) == {}  # the wide tile
    assert cap("fpass_b", bf16) == cap("fpass", bf16) == {}  # the two-chunk walks spill under a cap
    monkeypatch.setenv("HMSCALE_SSD_MAXNREG", "dx=128; dbc=0")
    assert cap("dx", bf16) == {"maxnreg": 128} and cap("dbc", bf16) == {}
    for bad in ("dbc", "dbc=lots", "dbc=300", "dbc=8", "dcb=168"):
        monkeypatch.setenv("HMSCALE_SSD_MAXNREG", bad)
        with pytest.raises(ValueError, match="HMSCALE_SSD_MAXNREG"):
            cap("dbc", bf16)


def test_an_unused_final_state_costs_no_zero_gradient():
    """The core's autograd Function let autograd materialise the unused final state's gradient: a (b, h, p, n) fp32
    tensor allocated and zero-filled on every backward (a kernel launch and host time on the GPU), then read by the
    backward walk. Now it arrives as None; gradients of y alone and of the final state alone match the reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    ins, _ = make_inputs(1, 40, 2, 2, 16, 16, dtype=torch.float32, init=True)
    dev_ins, _ = on_triton_device(ins)
    names = list(dev_ins)
    leaves = [t.clone().requires_grad_() for t in dev_ins.values()]
    ref_leaves = [t.double().clone().requires_grad_() for t in ins.values()]
    y, s = ssd(**dict(zip(names, leaves)), chunk_size=16, return_final_state=True, backend="triton")
    yr, sr = ssd_reference(**dict(zip(names, ref_leaves)), return_final_state=True)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ops = Ops()
    with ops:
        g = torch.autograd.grad(y, leaves, gy.to(y.dtype).to(y.device), retain_graph=True)
    assert not [n for n in ops.names if "zeros" in n or "fill" in n], ops.names
    gr = torch.autograd.grad(yr, ref_leaves, gy, retain_graph=True)
    for k, a, r in zip(names, g, gr):
        assert rel(a, r) < TOL, (k, rel(a, r))
    gs = torch.randn(s.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    g = torch.autograd.grad(s, leaves, gs.to(s.device).float())  # y unused: its gradient is zeros inside
    gr = torch.autograd.grad(sr, ref_leaves, gs, allow_unused=True)  # (C does not reach the final state)
    for k, a, r in zip(names, g, gr):
        if r is None:
            assert not a.abs().max(), k
        else:
            assert rel(a, r) < TOL, (k, rel(a, r))


def test_launch_plans_follow_the_switches_and_are_reused(monkeypatch):
    """Each call shape's launches are planned once (``fwd_plan`` / ``bwd_plan``, memoised with the switches' values):
    a repeated call computes no configuration; setting, changing or removing a switch gives the next call its plan,
    as the kernels it launches show; and the gradients stay those of the reference whichever plan ran."""
    import kernels.ssd_triton_bwd as bwd
    import kernels.ssd_triton_fwd as fwd

    launched, layouts = [], []
    real_launch, real_layout = fwd.launch, fwd.state_layout

    def record(fn, grid, *a, **k):
        launched.append(fn.fn.__name__)
        real_launch(fn, grid, *a, **k)

    monkeypatch.setattr(fwd, "launch", record)
    monkeypatch.setattr(bwd, "launch", record)
    monkeypatch.setattr(fwd, "state_layout", lambda *a, **k: layouts.append(1) or real_layout(*a, **k))
    monkeypatch.setattr(bwd, "state_layout", lambda *a, **k: layouts.append(1) or real_layout(*a, **k))
    monkeypatch.delenv("HMSCALE_SSD_CFG", raising=False)
    ins, seq = make_inputs(1, 40, 2, 2, 16, 16, dtype=torch.float32, D=True)
    gen = torch.Generator().manual_seed(1)
    gy, gs = torch.randn(1, 40, 2, 16, generator=gen, dtype=torch.float64), torch.randn(1, 2, 16, 16, generator=gen,
                                                                                       dtype=torch.float64)
    _, _, gr, _, _ = _run(ssd_reference, ins, seq, {}, 16, gy, gs)

    def call(pass_mode):
        if pass_mode is None:
            monkeypatch.delenv("HMSCALE_SSD_PASS", raising=False)
        else:
            monkeypatch.setenv("HMSCALE_SSD_PASS", pass_mode)
        launched.clear()
        layouts.clear()
        _, _, g, _, _ = _run(_triton, {k: v.float() for k, v in ins.items()}, seq, {}, 16, gy, gs,
                             device=TRITON_DEVICE)
        for k in g:
            assert rel(g[k], gr[k]) < TOL, (pass_mode, k, rel(g[k], gr[k]))
        return list(launched), len(layouts)

    call("fused")  # a process's first calls read switches for the first time: planned again once (switch_cached)
    call("fused")
    fused, planned = call("fused")
    assert planned == 0, "a repeated call shape computed its configuration again"
    assert "_state_fused_fwd" in fused and "_dstate_fused_bwd" in fused and "_chunk_state_fwd" not in fused
    split, planned = call("split")
    assert planned == 2, "a changed switch did not give the forward and the backward new plans"
    assert "_chunk_state_fwd" in split and "_state_pass_bwd" in split and "_state_fused_fwd" not in split
    assert call("fused")[0] == fused
    assert call(None)[0] == split  # auto on the CPU interpreter: the split passes
