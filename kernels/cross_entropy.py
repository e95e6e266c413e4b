"""Next-token cross-entropy straight from the LM head's logits in Triton: one kernel forward (an online
log-sum-exp over the vocabulary, per row), one backward (``softmax - onehot`` written in the logits' dtype).

The plain path (``F.cross_entropy`` on an fp32 copy, one sequence at a time under activation checkpointing, as
stage 2 did) makes several fp32 passes over the (rows x vocabulary) logits each way, recomputing the forward in
the backward; this reads the logits once forward and once backward and writes the gradient once. fp32 math;
logits in any float dtype. Rows whose target is ``ignore_index`` add nothing and get a zero gradient.
Reference: ``reference.cross_entropy_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

__all__ = ["cross_entropy_sum_triton", "next_token_cross_entropy_sum"]

_BLOCK_V = 2048


@triton.jit
def _ce_fwd(Z, T, LSE, LOSS, V, stride_row, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    # per-lane running max and sum of exp, merged once at the end
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        z = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        # lanes still at -inf (masked tail) keep s = 0 without producing NaN
        s = s * tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new)) + tl.where(z == float("-inf"), 0.0, tl.exp(z - m_new))
        m = m_new
    mx = tl.max(m, 0)
    total = tl.sum(s * tl.where(m == float("-inf"), 0.0, tl.exp(m - mx)), 0)
    lse = mx + tl.log(total)
    t = tl.load(T + row)
    keep = t != ignore_index
    zt = tl.load(base + tl.where(keep, t, 0)).to(tl.float32)
    tl.store(LSE + row, lse)
    tl.store(LOSS + row, tl.where(keep, lse - zt, 0.0))


@triton.jit
def _ce_bwd(Z, T, LSE, G, DZ, V, stride_row, stride_drow, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_row
    dbase = DZ + row * stride_drow
    cols = tl.arange(0, BLOCK_V)
    t = tl.load(T + row)
    g = tl.load(G).to(tl.float32) * tl.where(t != ignore_index, 1.0, 0.0)
    lse = tl.load(LSE + row)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        mask = c < V
        z = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
        d = (tl.exp(z - lse) - tl.where(c == t, 1.0, 0.0)) * g
        tl.store(dbase + c, d.to(DZ.dtype.element_ty), mask=mask)


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        rows, V = logits.shape
        lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
        loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
        if rows:
            launch(_ce_fwd, (rows,), logits, target, lse, loss, V, logits.stride(0), ignore_index, BLOCK_V=_BLOCK_V)
        ctx.save_for_backward(logits, target, lse)
        ctx.ignore_index = ignore_index
        return loss.sum()

    @staticmethod
    def backward(ctx, g):
        logits, target, lse = ctx.saved_tensors
        rows, V = logits.shape
        dz = torch.empty_like(logits, memory_format=torch.contiguous_format)
        if rows:
            launch(_ce_bwd, (rows,), logits, target, lse, g.reshape(1).float().contiguous(), dz, V,
                   logits.stride(0), dz.stride(0), ctx.ignore_index, BLOCK_V=_BLOCK_V)
        return dz, None, None


def cross_entropy_sum_triton(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum over rows of ``-log softmax(logits)[target]`` (fp32 scalar); logits (rows, V) with unit stride along V,
    target (rows,) integers (``ignore_index`` rows skipped). Triton; CUDA tensors, or CPU ones under
    ``TRITON_INTERPRET=1``."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_sum: logits {tuple(logits.shape)} must be (rows, V) and target "
                         f"{tuple(target.shape)} (rows,)")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return _CrossEntropySum.apply(logits, target.to(torch.int64).contiguous(), int(ignore_index))


def next_token_cross_entropy_sum(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Sum over positions t < l-1 of ``-log softmax(logits[:, t])[input_ids[:, t+1]]`` for (b, l, V) logits: the
    last position is an ignored row rather than a slice, so the gradient comes back in the logits' own (b, l, V)
    layout (no zero-filled copy for the slice's backward)."""
    b, l, V = logits.shape
    target = torch.full((b, l), -100, dtype=torch.int64, device=input_ids.device)
    target[:, :-1] = input_ids[:, 1:]
    return cross_entropy_sum_triton(logits.reshape(b * l, V), target.reshape(-1), ignore_index=-100)
