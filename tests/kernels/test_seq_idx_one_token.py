"""A one-token call with ``seq_idx`` (a decode step after a packed prompt): the document ids of one token were an
empty tensor, and the PyTorch chunked backend crashed on them. One token is one document, so the call equals the
same call without ``seq_idx`` (the carried state belongs to the input's first document)."""

import pytest
import torch

import kernels
from kernels.reference import doc_ids_from_seq_idx


def test_doc_ids_of_one_token():
    assert doc_ids_from_seq_idx(torch.tensor([[7], [3]]), 2, 1, "cpu").tolist() == [[0], [0]]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("normalize", [False, True])
def test_one_token_with_seq_idx_equals_without(backend, normalize):
    g = torch.Generator().manual_seed(0)
    b, h, p, n = 2, 2, 4, 8
    x = torch.randn(b, 1, h, p, generator=g, dtype=torch.float64)
    dt = torch.rand(b, 1, h, generator=g, dtype=torch.float64) + 0.1
    A = -torch.rand(h, generator=g, dtype=torch.float64)
    B = torch.rand(b, 1, 1, n, generator=g, dtype=torch.float64)
    C = torch.rand(b, 1, 1, n, generator=g, dtype=torch.float64)
    S0 = torch.rand(b, h, p + int(normalize), n, generator=g, dtype=torch.float64)
    kw = dict(initial_state=S0, normalize=normalize, return_final_state=True, backend=backend)
    y, s = kernels.ssd(x, dt, A, B, C, seq_idx=torch.tensor([[5], [2]], dtype=torch.int32), **kw)
    y0, s0 = kernels.ssd(x, dt, A, B, C, **kw)
    torch.testing.assert_close(y, y0, rtol=0, atol=0)
    torch.testing.assert_close(s, s0, rtol=0, atol=0)
