"""Under TRITON_INTERPRET=1 the interpreter (Triton 3.9) converts fp32 to bf16 by dropping the low mantissa bits
(rounding toward zero), where the GPU rounds to nearest even: every bf16 value a kernel stored (y, a bf16 decode
state, the bf16 operands of the split dots) was truncated, about half of them one ulp off the GPU's, all toward zero.
``kernels.interpreter`` rounds them to nearest even now, as the GPU and torch do."""

import os

import pytest
import torch

import kernels
from kernels.interpreter import patch_interpreter_bf16_dot
from kernels.step_torch import ssd_step_torch

from ._helpers import needs_triton

interpreting = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")


@needs_triton
@interpreting
def test_a_kernels_bf16_store_rounds_to_nearest_even():
    import triton
    import triton.language as tl

    patch_interpreter_bf16_dot()

    @triton.jit
    def copy(src, dst, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(dst + o, tl.load(src + o))  # implicit fp32 -> bf16

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=gen)
    x[:4] = torch.tensor([float("inf"), -float("inf"), 3.3895e38, 1.0 + 2.0 ** -8])  # overflow / a tie to even
    y = torch.empty(1024, dtype=torch.bfloat16)
    copy[(1,)](x, y, N=1024)
    assert torch.equal(y, x.to(torch.bfloat16))


@needs_triton
@interpreting
def test_bf16_decode_state_from_the_triton_step_is_rounded_like_the_torch_step():
    gen = torch.Generator().manual_seed(1)
    b, h, g, p, n = 2, 4, 2, 8, 16
    state = torch.randn(b, h, p, n, generator=gen).bfloat16()
    x = torch.randn(b, h, p, generator=gen).bfloat16()
    dt = torch.rand(b, h, generator=gen) * 0.5 + 0.05
    A = -(torch.rand(h, generator=gen) + 0.1)
    B, C = torch.randn(b, g, n, generator=gen).bfloat16(), torch.randn(b, g, n, generator=gen).bfloat16()
    y, new = kernels.ssd_step(state, x, dt, A, B, C, backend="triton")
    yr, nr = ssd_step_torch(state, x, dt, A, B, C)
    # the same fp32 arithmetic up to a last-bit difference, then one rounding: (nearly) every element equal
    # (truncating: ~50 % of them one ulp toward zero)
    assert (new != nr).float().mean() < 0.01 and (y != yr).float().mean() < 0.02
