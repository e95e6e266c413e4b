"""The two references agree with each other in float64, and with hand-checked special cases."""

import pytest
import torch

from kernels import ssd_recurrent_reference, ssd_reference

from ._helpers import make_inputs, rel

CASES = [
    dict(b=1, l=9, h=2, g=2, p=3, n=4),
    dict(b=2, l=17, h=4, g=1, p=5, n=3),
    dict(b=2, l=13, h=6, g=3, p=2, n=5),
]


@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("opts", [dict(), dict(D=True, init=True, seq=True),
                                  dict(normalize=True, D=True, init=True, seq=True)])
def test_quadratic_matches_recurrence(shape, opts):
    ins, seq = make_inputs(**shape, **opts)
    kw = dict(seq_idx=seq, normalize=opts.get("normalize", False), return_final_state=True)
    y1, s1 = ssd_reference(**ins, **kw)
    y2, s2 = ssd_recurrent_reference(**ins, **kw)
    assert rel(y1, y2) < 1e-12
    assert rel(s1, s2) < 1e-12


def test_no_decay_normaliser_is_linear_attention():
    """dt=1, A=0: the normaliser equals sum_{s<=t} C_t.B_s and y is normalised linear attention."""
    ins, _ = make_inputs(2, 11, 2, 2, 4, 6, normalize=True)
    ins["dt"] = torch.ones_like(ins["dt"])
    ins["A"] = torch.zeros_like(ins["A"])
    y = ssd_reference(**ins, normalize=True)
    att = torch.einsum("btgn,bsgn->bgts", ins["C"], ins["B"]).tril()
    num = torch.einsum("bhts,bshp->bthp", att, ins["x"])
    den = att.sum(-1).transpose(1, 2).unsqueeze(-1)
    assert rel(y, num / den) < 1e-12


def test_seq_idx_equals_separate_documents():
    ins, _ = make_inputs(1, 12, 2, 1, 3, 4)
    seq = torch.tensor([[7] * 5 + [2] * 7], dtype=torch.int32)
    y = ssd_reference(**ins, seq_idx=seq)
    first = {k: (v[:, :5] if v.dim() >= 3 else v) for k, v in ins.items()}
    second = {k: (v[:, 5:] if v.dim() >= 3 else v) for k, v in ins.items()}
    y1 = ssd_reference(**first)
    y2 = ssd_reference(**second)
    assert rel(y, torch.cat([y1, y2], 1)) < 1e-12


def test_gradcheck_reference():
    ins, seq = make_inputs(1, 5, 2, 1, 2, 3, D=True, init=True, seq=False)
    names = list(ins)
    leaves = [ins[k].clone().requires_grad_() for k in names]

    def f(*t):
        y, s = ssd_reference(**dict(zip(names, t)), return_final_state=True)
        return y, s

    assert torch.autograd.gradcheck(f, leaves, atol=1e-7, rtol=1e-6)
