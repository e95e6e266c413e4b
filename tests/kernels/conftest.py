import os

# The Triton tests run the kernels under the interpreter on CPU; must be set before triton is imported
# (tests/conftest.py does the same for the whole suite).
os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_bf16_dot():
    """The CPU interpreter (Triton 3.9) multiplies bf16 dot operands as raw uint16 bits; widen them to fp32
    first (exact), so the bf16 tensor-core paths (the bf16 hi/lo split) can be tested here. Interpreter only."""
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


_interpreter_bf16_dot()
