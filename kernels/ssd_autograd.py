"""autograd wiring of the Triton SSD, and the ``ssd_triton`` entry point.

By default (v2 backward) ``normalize`` and ``D`` are fused into the core: the states carry the normaliser as one
extra row (x keeps its P columns, no padded p tile), the scan kernel divides by it and adds ``D x`` before
writing y in the input dtype, keeping the fp32 numerator for the backward, whose first step
(``norm_bwd_prologue``) takes the gradient through the division. ``HMSCALE_SSD_NORM=cat`` (and the v1 backward)
instead appends a column of ones to x (the last state row and output column are then the normaliser, exactly
the same scan), and the division and ``D x`` are plain tensor ops on top of the core, for autograd.
No epsilon is added to the normaliser: callers must keep it away from zero (positive B, C feature maps
make it strictly positive).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .chunked_torch import check_ssd_args
from .reference import doc_ids_from_seq_idx
from .settings import env, env_frozen
from .ssd_triton_bwd import bwd_variant, ssd_bwd
from .ssd_triton_fwd import keeps_ynum, norm_bwd_prologue, save_y_mode, ssd_fwd, state_layout

__all__ = ["ssd_triton", "SSDCoreFunction", "core_fwd_op", "core_bwd_op", "norm_mode"]


def _core_forward(x, dt, A, B, C, initial_state, doc, chunk_size, out_dtype, norm, Dhp, save_ynum):
    """(y, final, states, gdec, ynum, den, sexp) of the Triton forward (dt heads-major, (b, h, l)); ynum and den are
    None when not kept, sexp (the states' exponents) empty unless they are stored as scaled fp16."""
    y, ynum, den, final, states, gdec, sexp = ssd_fwd(x, dt, A, B, C, initial_state, doc, chunk_size, out_dtype,
                                                      norm, Dhp, save_ynum=save_ynum)
    return y, final, states, gdec, ynum, den, sexp


def _core_backward(dy, dfinal, x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp, chunk_size, has_init, norm,
                   sexp):
    """(dx, ddt, dA, dB, dC, dinit, dD) of the Triton backward (dt, ddt heads-major; dinit, dD None when absent)."""
    with env_frozen():
        return _core_backward_switches_read(dy, dfinal, x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp,
                                            chunk_size, has_init, norm, sexp)


def _core_backward_switches_read(dy, dfinal, x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp, chunk_size,
                                 has_init, norm, sexp):
    if dy is None:
        dy = torch.zeros(x.shape, device=x.device, dtype=x.dtype)
    dden = None
    dyn = dy
    ys = dict(ysaved=ynum, den=den) if ynum is not None and save_y_mode() else {}  # ynum: v2 only (keeps_ynum)
    if norm and norm_bwd_mode() == "rowscale" and x.dtype == torch.bfloat16 and dy.dtype == torch.bfloat16:
        _, dden = norm_bwd_prologue(dy, ynum, den, write_dyn=False)
        return ssd_bwd(dy, dden, dfinal, x, dt, A, B, C, doc, states, gdec, chunk_size, has_init, D=Dhp, dyo=dy,
                       dy_den=den, sexp=sexp, **ys)
    if norm:
        dyn, dden = norm_bwd_prologue(dy, ynum, den)
    return ssd_bwd(dyn, dden, dfinal, x, dt, A, B, C, doc, states, gdec, chunk_size, has_init, D=Dhp, dyo=dy,
                   sexp=sexp, **ys)


def norm_bwd_mode() -> str:
    """``HMSCALE_SSD_NORM_BWD``: how the fused normaliser's backward hands the numerator's gradient dy / den to the
    kernels, for bf16 inputs. ``rowscale`` (default): the kernels read the output's bf16 gradient and apply 1 / den
    per row (exact bf16 dots, as without normalize); ``fp32``: the prologue writes dy / den in fp32 and the kernels
    take it as an fp32 operand (tf32 and 3-term split dots). fp16 and fp32 inputs always use ``fp32`` (an fp16 dy / den
    can leave the fp16 range)."""
    v = env("HMSCALE_SSD_NORM_BWD", "rowscale").lower()
    if v not in ("rowscale", "fp32"):
        raise ValueError(f"HMSCALE_SSD_NORM_BWD must be rowscale or fp32, got {v!r}")
    return v


def _d_hp(D, h, p):
    """The D skip as the (h, p) fp32 tensor the kernels fuse (autograd takes dD back to D's shape)."""
    return (D[:, None] if D.dim() == 1 else D).float().expand(h, p).contiguous()


class SSDCoreFunction(torch.autograd.Function):
    """The Triton core for eager autograd (the cheapest dispatch; compiled graphs use :func:`core_fwd_op`)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, initial_state, doc, chunk_size, out_dtype, norm=False, Dhp=None):
        # an unused output's gradient arrives as None, not as zeros autograd allocates and fills on every call (the
        # final state's, in training and in benchmarks): the backward then reads no dfinal
        ctx.set_materialize_grads(False)
        y, final, states, gdec, ynum, den, sexp = _core_forward(x, dt, A, B, C, initial_state, doc, chunk_size,
                                                                out_dtype, norm, Dhp, any(ctx.needs_input_grad))
        ctx.save_for_backward(x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp, sexp)
        ctx.chunk_size = chunk_size
        ctx.has_init = initial_state is not None
        ctx.norm = norm
        return y, final

    @staticmethod
    @once_differentiable  # the Triton backward is not differentiable: a second derivative raises, not silently 0
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp, sexp = ctx.saved_tensors
        dx, ddt, dA, dB, dC, dinit, dD = _core_backward(dy, dfinal, x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp,
                                                        ctx.chunk_size, ctx.has_init, ctx.norm, sexp)
        return dx, ddt, dA, dB, dC, dinit, None, None, None, None, dD


# The same core as two torch.library custom ops, for torch.compile: dynamo keeps an opaque op in the graph (the
# fake functions give its output shapes) instead of breaking the graph around the scan, and AOTAutograd puts
# the backward op in the backward graph. Absent optional outputs are empty tensors (an op returns tensors).
_Opt = Optional[torch.Tensor]
_OUT7 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _or_empty(t, like):
    return t if t is not None else like.new_empty(0, dtype=torch.float32)


def _none_if_empty(t):
    return None if t is None or t.numel() == 0 else t


@torch.library.custom_op("hmscale::ssd_core_fwd", mutates_args=())
def core_fwd_op(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                initial_state: _Opt, doc: _Opt, chunk_size: int, out_dtype: torch.dtype, norm: bool, Dhp: _Opt,
                save_ynum: bool) -> _OUT7:
    y, final, states, gdec, ynum, den, sexp = _core_forward(x, dt, A, B, C, initial_state, doc, chunk_size, out_dtype,
                                                            norm, Dhp, save_ynum)
    return y, final, states, gdec, _or_empty(ynum, x), _or_empty(den, x), sexp


@core_fwd_op.register_fake
def _(x, dt, A, B, C, initial_state, doc, chunk_size, out_dtype, norm, Dhp, save_ynum):
    b, l, h, p = x.shape
    n = B.shape[3]
    nc = -(-l // chunk_size)
    ps = p + int(norm)
    f32 = torch.float32
    st_dtype, gs, _ = state_layout(b, h, p, n, x.dtype, x.device, chunk_size)
    return (x.new_empty(b, l, h, p, dtype=out_dtype), x.new_empty(b, h, ps, n, dtype=f32),
            x.new_empty(b, h, nc, ps, n, dtype=st_dtype), x.new_empty(b * h, nc, dtype=f32),
            x.new_empty((b, l, h, p) if keeps_ynum(norm, save_ynum) else (0,), dtype=f32),
            x.new_empty((b, l, h) if norm else (0,), dtype=f32),
            x.new_empty((b, h, nc, ps, n // gs) if gs else (0,), dtype=torch.int8))


@torch.library.custom_op("hmscale::ssd_core_bwd", mutates_args=())
def core_bwd_op(dy: _Opt, dfinal: _Opt, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, doc: _Opt, states: torch.Tensor, gdec: torch.Tensor, ynum: torch.Tensor,
                den: torch.Tensor, Dhp: _Opt, chunk_size: int, has_init: bool, norm: bool,
                sexp: torch.Tensor) -> _OUT7:
    dx, ddt, dA, dB, dC, dinit, dD = _core_backward(dy, dfinal, x, dt, A, B, C, doc, states, gdec,
                                                    _none_if_empty(ynum), _none_if_empty(den), Dhp, chunk_size,
                                                    has_init, norm, sexp)
    return dx, ddt, dA, dB, dC, _or_empty(dinit, x), _or_empty(dD, x)


@core_bwd_op.register_fake
def _(dy, dfinal, x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp, chunk_size, has_init, norm, sexp):
    b, l, h, p = x.shape
    f32 = torch.float32
    return (torch.empty_like(x), x.new_empty(b, h, l, dtype=f32), x.new_empty(h, dtype=f32), torch.empty_like(B),
            torch.empty_like(C), x.new_empty((b, h, states.shape[3], B.shape[3]) if has_init else (0,), dtype=f32),
            x.new_empty((h, p) if Dhp is not None else (0,), dtype=f32))


def _op_setup_context(ctx, inputs, output):
    x, dt, A, B, C, initial_state, doc, chunk_size, out_dtype, norm, Dhp, save_ynum = inputs
    _, _, states, gdec, ynum, den, sexp = output
    ctx.save_for_backward(x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp, sexp)
    ctx.chunk_size, ctx.has_init, ctx.norm = chunk_size, initial_state is not None, norm
    ctx.set_materialize_grads(False)  # as the eager Function: an unused final state gives None, not zeros to read


def _op_backward(ctx, dy, dfinal, *_unused):
    x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp, sexp = ctx.saved_tensors
    dx, ddt, dA, dB, dC, dinit, dD = core_bwd_op(dy, dfinal, x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp,
                                                 ctx.chunk_size, ctx.has_init, ctx.norm, sexp)
    return (dx, ddt, dA, dB, dC, dinit if ctx.has_init else None, None, None, None, None,
            dD if Dhp is not None else None, None)


core_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def _core(xc, dtc, Ac, Bc, Cc, init, doc, chunk_size, out_dtype, norm=False, Dhp=None):
    """(y, final) of the core: the custom op inside a torch.compile graph, the autograd Function otherwise."""
    if torch.compiler.is_compiling():
        save = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                               for t in (xc, dtc, Ac, Bc, Cc, init, Dhp))
        y, final, *_ = core_fwd_op(xc, dtc, Ac, Bc, Cc, init, doc, chunk_size, out_dtype, norm, Dhp, save)
        return y, final
    return SSDCoreFunction.apply(xc, dtc, Ac, Bc, Cc, init, doc, chunk_size, out_dtype, norm, Dhp)


def norm_mode() -> str:
    """``fused`` (default: the normaliser is one extra state row inside the kernels) or ``cat`` (a column of ones
    appended to x; always used with the v1 backward). Env ``HMSCALE_SSD_NORM``."""
    v = env("HMSCALE_SSD_NORM", "fused").lower()
    if v not in ("fused", "cat"):
        raise ValueError(f"HMSCALE_SSD_NORM must be fused or cat, got {v!r}")
    return "cat" if bwd_variant() == "v1" else v


def _check(x, dt, A, B, C, chunk_size, D=None, initial_state=None, seq_idx=None, normalize=False):
    check_ssd_args(x, dt, A, B, C, chunk_size, D, initial_state, seq_idx, normalize)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"ssd: the Triton kernels take fp32, fp16 or bf16 x, got {x.dtype}; float64 runs on "
                         f"backend='torch' (what backend='auto' picks for it)")
    b, l, h, p = x.shape
    if l * h * (p + 1) >= 2 ** 31 or l * B.shape[2] * B.shape[3] >= 2 ** 31:
        raise ValueError("ssd: one sequence over 2^31 elements: the kernels index within a sequence in int32; split "
                         "it (initial_state carries the state across the pieces) or use backend='torch'")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"ssd: chunk_size must be a power of two >= 16 for the Triton kernel, got {chunk_size}")


def ssd_triton(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None,
               normalize=False, return_final_state=False):
    """The contract of :func:`kernels.ssd`, computed by the Triton kernels (the forward reads each ``HMSCALE_SSD_*``
    switch once: ``kernels.settings``)."""
    with env_frozen():
        return _ssd_triton(x, dt, A, B, C, chunk_size, D, initial_state, seq_idx, normalize, return_final_state)


def _ssd_triton(x, dt, A, B, C, chunk_size, D, initial_state, seq_idx, normalize, return_final_state):
    _check(x, dt, A, B, C, chunk_size, D, initial_state, seq_idx, normalize)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton SSD needs CUDA tensors (or TRITON_INTERPRET=1 set before importing "
                           "triton); use backend='torch' on CPU")
    b, l, h, p = x.shape
    xin = x
    xc = x.contiguous()
    # fused (the v2 default): the normaliser row lives in the kernels and the scan applies 1 / den and D x itself
    fused = bwd_variant() == "v2" and (not normalize or norm_mode() == "fused")
    if normalize and not fused:
        xc = torch.cat([xc, torch.ones_like(xc[..., :1])], dim=-1)
    # the kernels read dt heads-major, (b, h, l): one copy here (none when dt arrives stored that way; in a compiled
    # graph an op inductor may fuse with dt's producer); autograd hands ddt back through the transpose as a view
    dtc = dt.float().transpose(1, 2).contiguous()
    Ac = A.contiguous().float() if A.dtype != torch.float32 else A.contiguous()
    Bc = B.contiguous().to(x.dtype)
    Cc = C.contiguous().to(x.dtype)
    init = initial_state.contiguous().float() if initial_state is not None else None
    doc = doc_ids_from_seq_idx(seq_idx, b, l, x.device).contiguous() if seq_idx is not None else None
    if fused:
        Dhp = _d_hp(D, h, p) if D is not None else None
        y, final = _core(xc, dtc, Ac, Bc, Cc, init, doc, int(chunk_size), x.dtype, bool(normalize), Dhp)
        if return_final_state:
            return y, final
        return y
    out_dtype = torch.float32 if normalize else x.dtype
    y, final = _core(xc, dtc, Ac, Bc, Cc, init, doc, int(chunk_size), out_dtype)
    if normalize:
        y = y[..., :p] / y[..., p:]
    if D is not None:
        Dv = D[:, None] if D.dim() == 1 else D
        y = y + Dv.to(y.dtype) * xin.to(y.dtype)
    y = y.to(x.dtype)
    if return_final_state:
        return y, final
    return y
