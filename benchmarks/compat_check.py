"""``kernels.compat`` against mamba_ssm's own functions, same arguments, same inputs: ``mamba_chunk_scan_combined``
(outputs, final state, every gradient) and ``selective_state_update`` (one decode step: output and updated state).

    python benchmarks/compat_check.py                 # on a GPU (mamba_ssm from /tmp/anchors, as .whl/preamble.sh unpacks it)
    python benchmarks/compat_check.py --parts g=h     # one scan case (others: g=1, 1<g<h, decode, varlen)
    python benchmarks/compat_check.py --cpu           # on the CPU: both sides' Triton kernels under TRITON_INTERPRET=1
                                                      # (mamba_ssm from .anchors/mamba_ssm-*.tar.gz, `make gpu-wheels`)

For each case (its options: dt_bias with softplus and a binding dt_limit, D per head or per channel, the z gate,
initial_states, seq_idx, g = 1 / 1 < g < h / g = h, l not a multiple of the chunk): fresh random inputs, the output,
the final state and the gradients of every input (x, dt, A, B, C, D, z, dt_bias, initial_states), each compared by
||a - b|| / ||b|| between the two implementations and from each to the definition on the float64 reference
(``kernels.compat``'s docstring). The decode step: Mamba-2's tied form (one dt, A, dt_bias per head, expanded) and a
per-channel form, with D, z, dt_bias, softplus and state_batch_indices. The varlen states (cu_seqlens, batch 1).
Limits for ours against mamba_ssm: 1e-4 in
fp32 (tf32 off), 3e-2 in bf16 (two bf16 implementations, each ~1e-2 from float64). Where mamba_ssm's own result is
further than that from float64 (on the H200 its fp32 case is 1.4e-3 away, the size of TF32 rounding, ours 2.8e-6;
2026-12-05), the two may differ by up to twice its own error, and ours must then be within the limit of float64
(``agree``). Exit code 1 if a case fails.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import glob
import math
import os
import shutil
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path

if "--cpu" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _runinfo import header, mamba_ssm_version  # noqa: E402

from kernels import ssd_reference  # noqa: E402
from kernels.compat import mamba_chunk_scan_combined, selective_state_update  # noqa: E402

DEV = "cpu" if "--cpu" in sys.argv else "cuda"
LIMIT = (0.05, 1.5)
CASES = [  # (name, b, l, h, g, p, n, chunk of mamba_ssm)
    ("g=1", 2, 200, 4, 1, 32, 32, 64),
    ("1<g<h", 1, 150, 4, 2, 24, 48, 64),
    ("g=h", 2, 100, 4, 4, 16, 16, 32),
]


def unpack_mamba() -> str:
    """A directory holding the mamba_ssm package with an empty ``__init__`` (it imports CUDA extensions)."""
    if Path("/tmp/anchors/mamba_ssm/ops/triton/ssd_combined.py").exists():
        return "/tmp/anchors"
    tars = sorted(glob.glob(str(ROOT / ".anchors" / "mamba_ssm-*.tar.gz")))
    if not tars:
        sys.exit("mamba_ssm not found: run `make gpu-wheels` (it puts its source in .anchors/) or unpack it to "
                 "/tmp/anchors")
    out = Path(tempfile.mkdtemp(prefix="mamba_ssm_"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # one unpacked copy per run, gone when it ends
    with tarfile.open(tars[-1]) as tf:
        members = [m for m in tf.getmembers() if "/mamba_ssm/" in m.name and m.isfile()]
        for m in members:
            m.name = m.name.split("/", 1)[1]
        tf.extractall(out, members=members, filter="data")
    (out / "mamba_ssm" / "__init__.py").write_text("")
    return str(out)


def load_mamba():
    sys.path.insert(0, unpack_mamba())
    if DEV == "cpu":
        # mamba_ssm enters torch.cuda.device(x.device.index) around its launches (None on CPU tensors) and sizes
        # one backward grid by the multiprocessor count (an H200's 132 here); the interpreter has no benchmarker
        # for its autotuner: each autotuned kernel runs its first config
        torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
        torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=132)
        from triton.runtime.autotuner import Autotuner
        prune = Autotuner.prune_configs
        Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update as their_step
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as theirs
    return theirs, their_step


def inputs(b, l, h, g, p, n, dtype, d_per_channel, seed):
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    t = dict(x=rn(b, l, h, p), dt=rn(b, l, h), A=-(torch.rand(h, generator=gen, dtype=torch.float64) + 0.2),
             B=rn(b, l, g, n) / n ** 0.5, C=rn(b, l, g, n) / n ** 0.5, D=rn(h, p) if d_per_channel else rn(h),
             z=rn(b, l, h, p), dt_bias=rn(h) * 0.5, initial_states=rn(b, h, p, n))
    seq_idx = torch.zeros(b, l, dtype=torch.int32)
    seq_idx[:, l // 3:] = 1
    seq_idx[-1, 2 * l // 3:] = 2
    for k in ("x", "B", "C", "z"):  # the rest stays fp32 (mamba_ssm's dt, A, D, dt_bias may be any; ours fp32)
        t[k] = t[k].to(dtype)
    for k in ("dt", "A", "D", "dt_bias", "initial_states"):
        t[k] = t[k].float()
    return t, seq_idx


def definition(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx):
    d = F.softplus(dt + dt_bias).clamp(*LIMIT)
    y, s = ssd_reference(x, d, A, B, C, D=D, initial_state=initial_states, seq_idx=seq_idx, return_final_state=True)
    return y * F.silu(z), s


def run(fn, t, seq_idx, gy, gs, device, **kw):
    leaves = {k: v.to(device).clone().requires_grad_() for k, v in t.items()}
    y, s = fn(**leaves, seq_idx=seq_idx.to(device), **kw)
    loss = (y.double() * gy.to(device)).sum() + (s.double() * gs.to(device)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"y": y, "final": s, **{f"d{k}": g for k, g in zip(leaves, grads)}}


def case_errors(ours: dict, them: dict, ref: dict) -> tuple[str, float, float, float]:
    """(the field where the two differ most, that difference, ours' and theirs' worst error from float64) over every
    field of ``ref``; a NaN counts as the worst (max() alone keeps a NaN only when it comes first)."""
    def key(v):
        return math.inf if math.isnan(v) else v

    vs = {k: rel(ours[k], them[k]) for k in ref}
    worst = max(vs, key=lambda k: key(vs[k]))
    return (worst, vs[worst], max((rel(ours[k], ref[k]) for k in ref), key=key),
            max((rel(them[k], ref[k]) for k in ref), key=key))


def agree(ours_vs_them: float, ours_ref: float, them_ref: float, limit: float) -> bool:
    """The verdict on one case: the two implementations within ``limit`` of each other, or, where mamba_ssm's own error
    from float64 is above the limit, within twice that error and ours within the limit of float64."""
    if not all(math.isfinite(v) for v in (ours_vs_them, ours_ref, them_ref)):
        return False
    if ours_vs_them <= limit:
        return True
    return them_ref > limit and ours_ref <= limit and ours_vs_them <= 2 * them_ref


def varlen_cases(theirs, names, dtypes, seed) -> int:
    """``return_varlen_states`` with ``cu_seqlens`` (batch 1, sequences packed, seq_idx to match): the state after each
    sequence, both sides against the float64 scan cut after that sequence. Without initial_states ours must match
    theirs; with them it is printed only (see the module docstring of kernels.compat)."""
    print("varlen states    dtype  initial | ours vs mamba_ssm | ours vs fp64 | mamba_ssm vs fp64 | ok")
    fails = 0
    cuts = [0, 17, 18, 90, 150, 231]  # ends inside and at chunk boundaries (chunk 64), a one-token sequence
    for dname, initial in [(d, i) for d in names for i in (False, True)]:
        t, _ = inputs(1, cuts[-1], 4, 2, 24, 32, dtypes[dname], False, seed)
        cu = torch.tensor(cuts, dtype=torch.int32)
        seq_idx = torch.repeat_interleave(torch.arange(len(cuts) - 1, dtype=torch.int32), cu.diff().long())[None]
        init = t["initial_states"] if initial else None
        kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=LIMIT, return_varlen_states=True)

        def states(fn, dev):
            args = [t[k].to(dev) for k in ("x", "dt", "A", "B", "C")]
            out = fn(*args, 64, seq_idx=seq_idx.to(dev), cu_seqlens=cu.to(dev),
                     initial_states=None if init is None else init.to(dev), **{k: v.to(dev) if torch.is_tensor(v) else v
                                                                                 for k, v in kw.items()})
            return out[1]
        ours, them = states(mamba_chunk_scan_combined, DEV), states(theirs, DEV)
        d = F.softplus(t["dt"].double() + t["dt_bias"].double()).clamp(*LIMIT)
        ref = torch.stack([ssd_reference(t["x"][:, :e].double(), d[:, :e], t["A"].double(), t["B"][:, :e].double(),
                                         t["C"][:, :e].double(), seq_idx=seq_idx[:, :e], return_final_state=True,
                                         initial_state=None if init is None else init.double())[1][0] for e in cuts[1:]])
        limit = 1e-4 if dname == "fp32" else 3e-2
        e_vs, e_ours, e_them = rel(ours, them), rel(ours, ref), rel(them, ref)
        ok = math.isfinite(e_vs) and (initial or agree(e_vs, e_ours, e_them, limit))
        fails += not ok
        print(f"{'b1 l231 5 seqs':<16} {dname:<6} {'yes' if initial else 'no':<7} | {e_vs:.2e}          | {e_ours:.2e}    "
              f"| {e_them:.2e}         | {'ok' if ok else 'FAIL'}{' (printed only)' if initial else ''}")
        if initial:  # per sequence, to show where the two differ
            per = [f"{rel(ours[i], ref[i]):.1e}/{rel(them[i], ref[i]):.1e}" for i in range(len(cuts) - 1)]
            print(f"{'':<16} per sequence, ours/theirs vs fp64: {' '.join(per)}")
    return fails


def rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="both sides under TRITON_INTERPRET=1 on the CPU (fp32 only)")
    ap.add_argument("--dtypes", default=None, help="bf16,fp32 (default: both on a GPU, fp32 on the CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default=",".join([c[0] for c in CASES] + ["decode", "varlen"]),
                    help="what to check, comma-separated, of the scan cases " + ", ".join(c[0] for c in CASES)
                    + ", decode (the step) and varlen (cu_seqlens states); default all (on a GPU each scan case first "
                    "autotunes mamba_ssm's kernels, ~100 s: parts can run as parallel processes)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    known = [c[0] for c in CASES] + ["decode", "varlen"]
    if [q for q in parts if q not in known]:
        sys.exit(f"--parts: unknown {[q for q in parts if q not in known]}; choose from {', '.join(known)}")
    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("no GPU here: pass --cpu to run both sides under the Triton interpreter")
    names = (args.dtypes or ("fp32" if DEV == "cpu" else "bf16,fp32")).split(",")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    bad = [d for d in names if d not in dtypes]
    if bad:
        sys.exit(f"--dtypes: unknown {bad}; choose from bf16, fp32")
    if DEV == "cpu" and "bf16" in names:
        sys.exit("--cpu checks fp32 only: the interpreter's bf16 dots differ from the GPU's on mamba_ssm's side")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    theirs, their_step = load_mamba()
    print(header(DEV, f"baseline mamba_ssm {mamba_ssm_version()}" + (", TRITON_INTERPRET=1" if DEV == "cpu" else "")),
          flush=True)
    print(f"device: {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu (TRITON_INTERPRET=1)'}, torch "
          f"{torch.__version__}")
    if any(c[0] in parts for c in CASES):
        print("case            dtype  D      | worst ours vs mamba_ssm (field) | ours vs fp64 | mamba_ssm vs fp64 | s")
    fails = 0
    for (name, b, l, h, g, p, n, chunk), dname in [(c, d) for c in CASES if c[0] in parts for d in names]:
        for d_per_channel in (False, True):
            t0 = time.time()
            t, seq_idx = inputs(b, l, h, g, p, n, dtypes[dname], d_per_channel, args.seed)
            gen = torch.Generator().manual_seed(args.seed + 1)
            gy = torch.randn(b, l, h, p, generator=gen, dtype=torch.float64)
            gs = torch.randn(b, h, p, n, generator=gen, dtype=torch.float64)
            kw = dict(dt_softplus=True, dt_limit=LIMIT, return_final_states=True)
            ours = run(lambda **k: mamba_chunk_scan_combined(chunk_size=chunk, **k), t, seq_idx, gy, gs, DEV, **kw)
            them = run(lambda **k: theirs(chunk_size=chunk, **k), t, seq_idx, gy, gs, DEV, **kw)
            ref = run(definition, {k: v.double() for k, v in t.items()}, seq_idx, gy, gs, "cpu")
            worst, e_vs, ours_ref, them_ref = case_errors(ours, them, ref)
            limit = 1e-4 if dname == "fp32" else 3e-2
            ok = agree(e_vs, ours_ref, them_ref, limit)
            fails += not ok
            print(f"{name:<15} {dname:<6} {'(h,p)' if d_per_channel else '(h,)':<6} | {e_vs:.2e} ({worst:<15}) "
                  f"{'ok' if ok else 'FAIL'} | {ours_ref:.2e}    | {them_ref:.2e}         | {time.time() - t0:.0f}")
    if "decode" in parts:
        print()
        print("decode step      dtype  form         | ours vs mamba_ssm: out, state | ok")
    for dname, tied in [(d, t) for d in names for t in (True, False) if "decode" in parts]:
        b, h, g, p, n, pool = 3, 8, 2, 32, 64, 5
        gen = torch.Generator().manual_seed(args.seed + 2)
        rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
        dt_dtype = dtypes[dname]
        if tied:
            dt = rn(b, h)[..., None].expand(b, h, p)
            A = -(torch.rand(h, generator=gen) + 0.2)[:, None, None].expand(h, p, n)
            bias = (rn(h) * 0.5)[:, None].expand(h, p)
        else:
            dt, A, bias = rn(b, h, p), -(torch.rand(h, p, n, generator=gen) + 0.2), rn(h, p) * 0.5
        t = dict(x=rn(b, h, p).to(dt_dtype), dt=dt.to(dt_dtype), A=A, B=rn(b, g, n).to(dt_dtype),
                 C=rn(b, g, n).to(dt_dtype), D=rn(h, p), z=rn(b, h, p).to(dt_dtype), dt_bias=bias)
        t = {k: v.to(DEV) for k, v in t.items()}
        idx = torch.tensor([3, 0, 4], device=DEV)
        pool_state = rn(pool, h, p, n).to(DEV)
        s_ours, s_them = pool_state.clone(), pool_state.clone()
        y_ours = selective_state_update(s_ours, **t, dt_softplus=True, state_batch_indices=idx)
        y_them = their_step(s_them, **t, dt_softplus=True, state_batch_indices=idx)
        e_y, e_s = rel(y_ours, y_them), rel(s_ours, s_them)
        limit = 1e-4 if dname == "fp32" else 3e-2
        ok = all(math.isfinite(v) and v <= limit for v in (e_y, e_s))
        fails += not ok
        print(f"{'b3 h8 g2 p32 n64':<16} {dname:<6} {'tied (Mamba-2)' if tied else 'per-channel':<12} | {e_y:.2e}, {e_s:.2e}"
              f"              | {'ok' if ok else 'FAIL'}")
    if "varlen" in parts:
        print()
        fails += varlen_cases(theirs, names, dtypes, args.seed)
    print("PASS" if not fails else f"FAIL: {fails} case(s) over the limit")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
