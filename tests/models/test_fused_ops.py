"""The mixer's conv module: its document-aware loop and the glue path (fused_ops; the Triton kernels' own tests
against their references are in tests/kernels) compute the same thing for one document."""

import torch

from hmscale.models.hedgemamba import CausalDepthwiseConv


def test_conv_module_uses_the_same_math_with_and_without_documents():
    torch.manual_seed(2)
    conv = CausalDepthwiseConv(5, 4)
    with torch.no_grad():
        conv.weight.normal_()
    x = torch.randn(2, 8, 5)
    fast, st_fast = conv(x)
    slow, st_slow = conv(x, seq_idx=torch.zeros(2, 8, dtype=torch.long))  # one document: same result, loop path
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(st_fast, st_slow)


def test_compiled_glue_switch_defaults_to_the_triton_custom_ops(monkeypatch):
    """Inside a compiled graph on the Triton backend the glue runs as the kernels' custom ops unless
    HMSCALE_COMPILED_GLUE=inductor; outside compiled graphs the switch is off; a typo is a clear error."""
    import pytest

    import kernels
    from hmscale.models import fused_ops

    x = torch.randn(2, 3)
    monkeypatch.setattr(kernels, "resolve_backend", lambda t: "triton")
    monkeypatch.delenv("HMSCALE_COMPILED_GLUE", raising=False)
    assert not fused_ops.compiled_glue_on_triton(x)  # not compiling
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fused_ops.compiled_glue_on_triton(x)
    monkeypatch.setenv("HMSCALE_COMPILED_GLUE", "Inductor")
    assert not fused_ops.compiled_glue_on_triton(x)
    monkeypatch.setenv("HMSCALE_COMPILED_GLUE", "trition")
    with pytest.raises(ValueError, match="HMSCALE_COMPILED_GLUE must be triton or inductor"):
        fused_ops.compiled_glue_on_triton(x)
    monkeypatch.setattr(kernels, "resolve_backend", lambda t: "torch")
    monkeypatch.setenv("HMSCALE_COMPILED_GLUE", "triton")
    assert not fused_ops.compiled_glue_on_triton(x)  # the CPU path never takes the kernels
