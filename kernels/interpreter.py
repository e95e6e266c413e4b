"""Running the Triton kernels on the CPU under ``TRITON_INTERPRET=1`` (tests, and ``benchmarks/ssd_gpu_check.py
--cpu``): a fix for the interpreter's bf16 dots."""

from __future__ import annotations

import os


def patch_interpreter_bf16_dot() -> None:
    """The CPU interpreter (Triton 3.9) multiplies bf16 dot operands as raw uint16 bits; widen them to fp32 first
    (exact), so the bf16 tensor-core paths (the bf16 hi/lo split) compute what the GPU does. Interpreter only; a
    second call does nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as it
    except Exception:  # pragma: no cover - triton missing or changed
        return
    if getattr(it.InterpreterBuilder.create_dot, "_hmscale_bf16", False):
        return
    orig = it.InterpreterBuilder.create_dot

    def widen(hd):
        if hd.dtype.scalar == tl.bfloat16:
            data = it._convert_float(hd.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return it.TensorHandle(data, tl.float32)
        return hd

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._hmscale_bf16 = True
    it.InterpreterBuilder.create_dot = create_dot
