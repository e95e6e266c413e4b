"""Stage 2's loss straight from the LM head's logits in Triton: next-token cross-entropy and, optionally, the KD
term at a temperature, against cached teacher top-k log-probs or the live teacher's full logits. One kernel forward (online log-sum-exps over the
vocabulary, per row: of z, and of z / T for KD), one backward (``softmax - onehot`` and ``T (softmax(z / T) - p)``
written once, in the logits' dtype; the teacher's k sparse terms are a scatter-add of (rows x k) values).

The plain path (``F.cross_entropy`` / ``log_softmax`` on an fp32 copy, one sequence at a time under activation
checkpointing) makes several fp32 passes over the (rows x vocabulary) logits each way and recomputes the forward
in the backward; this reads the logits once forward and once backward and writes the gradient once. fp32 math;
logits in any float dtype. Rows whose target is ``ignore_index`` add nothing and get a zero gradient.

With p = softmax(teacher top-k log-probs / T) (k entries) and lse_T = logsumexp(z / T), a row's KD term is
``T^2 (lse_T - sum_k p_k z[i_k] / T)`` (= ``-T^2 sum_k p_k log_softmax(z / T)[i_k]``), its gradient
``T (softmax(z / T) - sum_k p_k onehot(i_k))``. References: ``reference.cross_entropy_reference`` and stage 2's
per-sequence path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

__all__ = ["cross_entropy_sum_triton", "next_token_loss_sums"]

_BLOCK_V = 2048


@triton.jit
def _online_lse_step(m, s, z):
    """Per-lane running max m and sum of exp(z - m); lanes still at -inf (the masked tail) stay NaN-free."""
    m_new = tl.maximum(m, z)
    s = s * tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new)) + tl.where(z == float("-inf"), 0.0, tl.exp(z - m_new))
    return m_new, s


@triton.jit
def _merge_lse(m, s):
    mx = tl.max(m, 0)
    return mx + tl.log(tl.sum(s * tl.where(m == float("-inf"), 0.0, tl.exp(m - mx)), 0))


# KD_MODE: 0 none, 1 the cached teacher top-k (dense part in the kernels, k sparse terms outside), 2 the live
# teacher's full logits TZ (read in both kernels)
@triton.jit
def _loss_fwd(Z, T, LSE, LSE_T, LOSS, TZ, LSE_TEACH, KD_ROW, V, stride_row, stride_trow, ignore_index, inv_temp,
              temp, KD_MODE: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    m2 = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s2 = tl.zeros((BLOCK_V,), tl.float32)
    mt = tl.full((BLOCK_V,), float("-inf"), tl.float32)  # teacher: running max of u = tz / T,
    st = tl.zeros((BLOCK_V,), tl.float32)  # sum of exp(u - mt),
    at = tl.zeros((BLOCK_V,), tl.float32)  # and sum of exp(u - mt) (u - z / T)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        mask = c < V
        z = tl.load(base + c, mask=mask, other=float("-inf")).to(tl.float32)
        m, s = _online_lse_step(m, s, z)
        if KD_MODE > 0:
            m2, s2 = _online_lse_step(m2, s2, z * inv_temp)
        if KD_MODE == 2:
            u = tl.load(TZ + row * stride_trow + c, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
            mt_new = tl.maximum(mt, u)
            scale = tl.where(mt_new == float("-inf"), 0.0, tl.exp(mt - mt_new))
            e = tl.where(mask, tl.exp(u - mt_new), 0.0)
            st = st * scale + e
            at = at * scale + e * tl.where(mask, u - z * inv_temp, 0.0)
            mt = mt_new
    lse = _merge_lse(m, s)
    t = tl.load(T + row)
    keep = t != ignore_index
    valid = (t >= 0) & (t < V)  # a target outside [0, V): NaN, never a read outside the row (_check_targets raises)
    zt = tl.load(base + tl.where(keep & valid, t, 0)).to(tl.float32)
    tl.store(LSE + row, lse)
    tl.store(LOSS + row, tl.where(keep, tl.where(valid, lse - zt, float("nan")), 0.0))
    if KD_MODE > 0:
        lse_s = _merge_lse(m2, s2)
        tl.store(LSE_T + row, lse_s)
    if KD_MODE == 2:
        mx = tl.max(mt, 0)
        w = tl.where(mt == float("-inf"), 0.0, tl.exp(mt - mx))
        tot = tl.sum(st * w, 0)
        lse_teach = mx + tl.log(tot)
        # KL(p_teacher || p_student) at T = sum_j p_j (u_j - z_j / T) - lse_teacher + lse_student
        kl = tl.sum(at * w, 0) / tot - lse_teach + lse_s
        tl.store(LSE_TEACH + row, lse_teach)
        tl.store(KD_ROW + row, tl.where(keep, kl * temp * temp, 0.0))


@triton.jit
def _loss_bwd(Z, T, LSE, LSE_T, TZ, LSE_TEACH, G, DZ, V, stride_row, stride_trow, stride_drow, ignore_index,
              inv_temp, temp, KD_MODE: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_row
    dbase = DZ + row * stride_drow
    cols = tl.arange(0, BLOCK_V)
    t = tl.load(T + row)
    keep = tl.where(t != ignore_index, 1.0, 0.0)
    bad = (t != ignore_index) & ((t < 0) | (t >= V))  # as the forward: NaN for a target outside [0, V)
    g_ce = tl.load(G).to(tl.float32) * keep
    lse = tl.load(LSE + row)
    g_kd = 0.0
    lse_t = 0.0
    lse_teach = 0.0
    if KD_MODE > 0:
        g_kd = tl.load(G + 1).to(tl.float32) * keep * temp
        lse_t = tl.load(LSE_T + row)
    if KD_MODE == 2:
        lse_teach = tl.load(LSE_TEACH + row)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        mask = c < V
        z = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
        d = (tl.exp(z - lse) - tl.where(c == t, 1.0, 0.0)) * g_ce
        if KD_MODE == 1:
            d += tl.exp(z * inv_temp - lse_t) * g_kd
        if KD_MODE == 2:
            u = tl.load(TZ + row * stride_trow + c, mask=mask, other=0.0).to(tl.float32) * inv_temp
            d += (tl.exp(z * inv_temp - lse_t) - tl.exp(u - lse_teach)) * g_kd
        d = tl.where(bad, float("nan"), d)
        tl.store(dbase + c, d.to(DZ.dtype.element_ty), mask=mask)


class _LossSums(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, topk_ids, p_teacher, teacher_logits, temperature, ignore_index):
        rows, V = logits.shape
        mode = 2 if teacher_logits is not None else 1 if topk_ids is not None else 0
        dev = logits.device
        f32 = dict(device=dev, dtype=torch.float32)
        lse = torch.empty(rows, **f32)
        lse_t = torch.empty(rows if mode else 1, **f32)
        loss = torch.empty(rows, **f32)
        lse_teach = torch.empty(rows if mode == 2 else 1, **f32)
        kd_row = torch.empty(rows if mode == 2 else 1, **f32)
        tz = teacher_logits if mode == 2 else logits  # (a placeholder pointer when there is no teacher)
        _check_targets(target, V, ignore_index)
        if rows:
            launch(_loss_fwd, (rows,), logits, target, lse, lse_t, loss, tz, lse_teach, kd_row, V, logits.stride(0),
                   tz.stride(0), ignore_index, 1.0 / temperature, float(temperature), KD_MODE=mode, BLOCK_V=_BLOCK_V)
        ce_sum = loss.sum()
        keep = None
        if mode == 1:
            keep = (target != ignore_index).float()
            z_k = logits.gather(1, topk_ids).float()
            kd_sum = (temperature * temperature * keep * (lse_t - (p_teacher * z_k).sum(-1) / temperature)).sum()
        elif mode == 2:
            kd_sum = kd_row.sum()
        else:
            kd_sum = torch.zeros((), **f32)
        ctx.save_for_backward(logits, target, lse, lse_t, topk_ids, p_teacher, keep,
                              teacher_logits if mode == 2 else None, lse_teach)
        ctx.temperature, ctx.ignore_index, ctx.mode = temperature, ignore_index, mode
        return ce_sum, kd_sum

    @staticmethod
    def backward(ctx, g_ce, g_kd):
        logits, target, lse, lse_t, topk_ids, p_teacher, keep, teacher_logits, lse_teach = ctx.saved_tensors
        rows, V = logits.shape
        T = ctx.temperature
        zero = torch.zeros((), device=logits.device, dtype=torch.float32)
        g = torch.stack([(g_ce if g_ce is not None else zero).float().reshape(()),
                         (g_kd if g_kd is not None else zero).float().reshape(())])
        dz = torch.empty_like(logits, memory_format=torch.contiguous_format)
        tz = teacher_logits if ctx.mode == 2 else logits
        if rows:
            launch(_loss_bwd, (rows,), logits, target, lse, lse_t, tz, lse_teach, g, dz, V, logits.stride(0),
                   tz.stride(0), dz.stride(0), ctx.ignore_index, 1.0 / T, float(T), KD_MODE=ctx.mode, BLOCK_V=_BLOCK_V)
        if ctx.mode == 1:  # the teacher's k sparse terms: -T p_k at (row, i_k)
            dz.scatter_add_(1, topk_ids, (-(g[1] * T) * p_teacher * keep[:, None]).to(dz.dtype))
        return dz, None, None, None, None, None, None


def _check_targets(target: torch.Tensor, V: int, ignore_index: int) -> None:
    """A target outside [0, V) that is not ``ignore_index`` is an error, as in ``F.cross_entropy`` (which raises on
    the CPU and stops at a device-side assert on CUDA): ``torch._assert_async``, so no host synchronisation on CUDA.
    (Without this the row's loss would read another row's logit, or memory past the logits; the kernels also give
    such a row a NaN loss and gradient.)"""
    if target.numel():
        bad = (target != ignore_index) & ((target < 0) | (target >= V))
        torch._assert_async(~bad.any(), f"cross_entropy: a target is outside [0, {V}) (the logits' vocabulary) and is "
                                        f"not ignore_index={ignore_index}")


def _check_2d(logits, target):
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_sum: logits {tuple(logits.shape)} must be (rows, V) and target "
                         f"{tuple(target.shape)} (rows,)")
    return logits if logits.stride(1) == 1 else logits.contiguous()


def cross_entropy_sum_triton(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum over rows of ``-log softmax(logits)[target]`` (fp32 scalar); logits (rows, V), target (rows,) integers
    (``ignore_index`` rows skipped). Triton; CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``."""
    logits = _check_2d(logits, target)
    return _LossSums.apply(logits, target.to(torch.int64).contiguous(), None, None, None, 1.0, int(ignore_index))[0]


def next_token_loss_sums(logits: torch.Tensor, input_ids: torch.Tensor, topk_ids: torch.Tensor | None = None,
                         topk_logprobs: torch.Tensor | None = None, temperature: float = 1.0,
                         teacher_logits: torch.Tensor | None = None):
    """(ce_sum, kd_sum) over positions t < l-1 of (b, l, V) logits: ``-log softmax(z_t)[input_ids[t+1]]`` and,
    given the teacher's top-k at each position (``topk_ids``, ``topk_logprobs``: (b, l, k); the prediction at t is
    for token t+1), ``-T^2 sum_k softmax(topk_logprobs_t / T)_k log_softmax(z_t / T)[topk_ids_t,k]`` (kd_sum is 0
    without them); or, given the live teacher's ``teacher_logits`` (b, l, V' >= V; its first V columns are read),
    the full-vocabulary ``T^2 KL(softmax(teacher / T) || softmax(z / T))``. The last position is an ignored row
    rather than a slice, so the gradient comes back in the logits' own (b, l, V) layout."""
    b, l, V = logits.shape
    if (topk_ids is None) != (topk_logprobs is None):
        raise ValueError("next_token_loss_sums: give both topk_ids and topk_logprobs, or neither")
    if temperature <= 0:
        raise ValueError(f"next_token_loss_sums: temperature must be > 0, got {temperature}")
    if teacher_logits is not None:
        if topk_ids is not None:
            raise ValueError("next_token_loss_sums: give the teacher's top-k or its full logits, not both")
        if teacher_logits.shape[:2] != (b, l) or teacher_logits.shape[-1] < V:
            raise ValueError(f"next_token_loss_sums: teacher logits {tuple(teacher_logits.shape)} must be (b, l, >= V) "
                             f"for logits {tuple(logits.shape)}")
        # a view (rows strided by the teacher's V') whenever (b, l) merge, which they do for a whole logits tensor
        teacher_logits = teacher_logits[..., :V].reshape(b * l, V)
        if teacher_logits.stride(1) != 1:
            teacher_logits = teacher_logits.contiguous()
    target = torch.full((b, l), -100, dtype=torch.int64, device=input_ids.device)
    target[:, :-1] = input_ids[:, 1:]
    ids = p = None
    if topk_ids is not None:
        if topk_ids.shape[:2] != (b, l) or topk_logprobs.shape != topk_ids.shape:
            raise ValueError(f"next_token_loss_sums: top-k ids {tuple(topk_ids.shape)} and log-probs "
                             f"{tuple(topk_logprobs.shape)} must both be (b, l, k) for logits {tuple(logits.shape)}")
        k = topk_ids.shape[-1]
        ids = topk_ids.reshape(b * l, k).to(torch.int64).contiguous()
        p = torch.softmax(topk_logprobs.reshape(b * l, k).float() / temperature, dim=-1).contiguous()
    z = _check_2d(logits.reshape(b * l, V), target.reshape(-1))
    return _LossSums.apply(z, target.reshape(-1), ids, p, teacher_logits, float(temperature), -100)
