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
