import os

# The Triton tests run the kernels under the interpreter on CPU; must be set before triton is imported
# (tests/conftest.py does the same for the whole suite).
os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.interpreter import patch_interpreter_bf16_dot, patch_interpreter_device_calls  # noqa: E402

patch_interpreter_bf16_dot()  # the interpreter's bf16 dots as the GPU computes them
patch_interpreter_device_calls()  # (the language patched once per launch, not once per helper call)
