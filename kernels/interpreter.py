"""Running the Triton kernels on the CPU under ``TRITON_INTERPRET=1`` (tests, and ``benchmarks/ssd_gpu_check.py
--cpu``): fixes for the interpreter's bf16 dots and bf16 rounding."""

from __future__ import annotations

import os


def patch_interpreter_bf16_dot() -> None:
    """The CPU interpreter (Triton 3.9) multiplies bf16 dot operands as raw uint16 bits; widen them to fp32 first
    (exact), so the bf16 tensor-core paths (the bf16 hi/lo split) compute what the GPU does. It also converts fp32 to
    bf16 by dropping the low mantissa bits (toward zero: every stored bf16 output, and every ``.to(tl.bfloat16)``);
    round to nearest even instead, as the GPU does. Interpreter only; a second call does nothing."""
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
    orig_cast = getattr(it.InterpreterBuilder, "cast_impl", None)  # (an interpreter without it: dots fixed only)

    def widen(hd):
        if hd.dtype.scalar == tl.bfloat16:
            data = it._convert_float(hd.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return it.TensorHandle(data, tl.float32)
        return hd

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            import torch

            f32 = np.array(src.data, dtype=np.float32)  # (a copy: torch shares the buffer)
            bits = torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return it.TensorHandle(bits, dst_type.scalar)  # round to nearest even (inf, nan kept), as the GPU
        return orig_cast(self, src, dst_type)

    create_dot._hmscale_bf16 = True
    it.InterpreterBuilder.create_dot = create_dot
    if orig_cast is not None:
        it.InterpreterBuilder.cast_impl = cast_impl


def patch_interpreter_device_calls() -> None:
    """The interpreter (Triton 3.9) patches ``triton.language`` again on every call of a ``@triton.jit`` helper from
    inside a kernel (our kernels call their tile helpers thousands of times per launch: ~30 % of a CPU test's time),
    although the kernel's launch has patched the same modules already. Skip that repeat while a grid runs and the
    helper sees no language module the running grid has not patched (``triton.language`` itself, or its ``core``,
    which Triton's own helpers such as ``tl.zeros`` call); anything else patches as before. Interpreter only; a
    second call does nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except Exception:  # pragma: no cover - triton missing or changed
        return
    grid_cls, fn_cls = getattr(it, "GridExecutor", None), getattr(it, "InterpretedFunction", None)
    if grid_cls is None or fn_cls is None or getattr(fn_cls.__call__, "_hmscale_once", False):
        return
    running, patched, langs = [0], set(), {}  # grids running; the language modules patched meanwhile; per function

    def langs_of(fn) -> frozenset:  # the modules Triton's `_patch_lang(fn)` patches
        if fn not in langs:
            langs[fn] = frozenset(id(m) for m in fn.__globals__.values() if m is tl or m is tl.core)
        return langs[fn]

    grid_call, fn_call = grid_cls.__call__, fn_cls.__call__

    def call_grid(self, *args, **kwargs):
        if not running[0]:
            patched.clear()
        running[0] += 1
        try:
            patched.update(langs_of(self.fn))  # (what its launch patches, first thing)
            return grid_call(self, *args, **kwargs)
        finally:
            running[0] -= 1

    def call_helper(self, *args, **kwargs):
        if not running[0] or not langs_of(self.fn) <= patched:
            if running[0]:
                patched.update(langs_of(self.fn))
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()  # (what fn_call does after its patching)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise it.InterpreterError(repr(e)) from e

    call_helper._hmscale_once = True
    grid_cls.__call__ = call_grid
    fn_cls.__call__ = call_helper
