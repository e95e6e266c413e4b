"""The chunked PyTorch path (CPU model path) equals the reference, with autograd gradients."""

import pytest
import torch

from kernels import ssd, ssd_chunked_torch, ssd_reference

from ._helpers import make_inputs, rel


@pytest.mark.parametrize("shape,chunk", [
    (dict(b=2, l=19, h=4, g=2, p=3, n=5), 4),   # l not a multiple of the chunk
    (dict(b=1, l=16, h=2, g=2, p=6, n=2), 8),   # g = h
    (dict(b=2, l=7, h=3, g=1, p=2, n=4), 16),  # single (partial) chunk, g = 1
])
@pytest.mark.parametrize("opts", [dict(), dict(D=True, init=True, seq=True),
                                  dict(normalize=True, D=True, init=True, seq=True)])
def test_chunked_matches_reference_float64(shape, chunk, opts):
    ins, seq = make_inputs(**shape, **opts)
    kw = dict(seq_idx=seq, normalize=opts.get("normalize", False), return_final_state=True)
    leaves = {k: v.clone().requires_grad_() for k, v in ins.items()}
    y1, s1 = ssd_chunked_torch(**leaves, chunk_size=chunk, **kw)
    y2, s2 = ssd_reference(**ins, **kw)
    assert rel(y1, y2) < 1e-12
    assert rel(s1, s2) < 1e-12
    gy = torch.randn_like(y1)
    gs = torch.randn_like(s1)
    g1 = torch.autograd.grad((y1 * gy).sum() + (s1 * gs).sum(), list(leaves.values()))
    ref_leaves = {k: v.clone().requires_grad_() for k, v in ins.items()}
    y2, s2 = ssd_reference(**ref_leaves, **kw)
    g2 = torch.autograd.grad((y2 * gy).sum() + (s2 * gs).sum(), list(ref_leaves.values()))
    for k, a, b in zip(leaves, g1, g2):
        assert rel(a, b) < 1e-10, k


def test_gradcheck_chunked():
    ins, seq = make_inputs(1, 7, 2, 1, 2, 3, D=True, init=True, seq=True)
    names = list(ins)
    leaves = [ins[k].clone().requires_grad_() for k in names]

    def f(*t):
        return ssd_chunked_torch(**dict(zip(names, t)), chunk_size=4, seq_idx=seq, return_final_state=True)

    assert torch.autograd.gradcheck(f, leaves, atol=1e-7, rtol=1e-6)


def test_float32_cpu_default_backend(monkeypatch):
    monkeypatch.delenv("HMSCALE_SSD_BACKEND", raising=False)
    ins, seq = make_inputs(2, 70, 4, 2, 8, 16, dtype=torch.float32, D=True, init=True, seq=True)
    y = ssd(**ins, seq_idx=seq)  # CPU tensors -> chunked PyTorch path
    ref = ssd_reference(**{k: v.double() for k, v in ins.items()}, seq_idx=seq)
    assert y.dtype == torch.float32
    assert rel(y, ref) < 1e-5
