"""Decode step: stepping token by token reproduces the chunked output and final state."""

import pytest
import torch

from kernels import ssd_reference, ssd_step
from kernels.step import ssd_step_torch

from ._helpers import make_inputs, needs_triton, on_triton_device, rel


def _roll(step_fn, ins, normalize):
    x, dt, A, B, C = (ins[k] for k in ("x", "dt", "A", "B", "C"))
    b, l, h, p = x.shape
    n = B.shape[-1]
    state = ins.get("initial_state")
    if state is None:
        state = torch.zeros(b, h, p + int(normalize), n, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    ys = []
    for t in range(l):
        y, state = step_fn(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=ins.get("D"), normalize=normalize)
        ys.append(y)
    return torch.stack(ys, 1), state


@pytest.mark.parametrize("normalize", [False, True])
def test_torch_step_matches_reference(normalize):
    ins, _ = make_inputs(2, 9, 4, 2, 3, 5, normalize=normalize, D=True, init=True)
    y, s = _roll(lambda *a, **k: ssd_step(*a, **k, backend="torch"), ins, normalize)
    yr, sr = ssd_reference(**ins, normalize=normalize, return_final_state=True)
    assert rel(y, yr) < 1e-12
    assert rel(s, sr) < 1e-12


@needs_triton
@pytest.mark.parametrize("normalize,g,p", [(False, 2, 20), (True, 1, 40), (True, 4, 8)])
def test_triton_step_matches_torch_step(normalize, g, p):
    ins, _ = make_inputs(2, 3, 4, g, p, 24, dtype=torch.float32, normalize=normalize, D=True, init=True)
    dev, _ = on_triton_device(ins)
    st = dev["initial_state"]
    for t in range(3):
        args = (st, dev["x"][:, t], dev["dt"][:, t], dev["A"], dev["B"][:, t], dev["C"][:, t])
        y1, s1 = ssd_step(*args, D=dev["D"], normalize=normalize, backend="triton")
        y2, s2 = ssd_step_torch(*(a.cpu() for a in args), D=ins["D"], normalize=normalize)
        assert rel(y1, y2) < 1e-6 and rel(s1, s2) < 1e-6
        st = s1


def test_step_gradients_flow():
    ins, _ = make_inputs(1, 1, 2, 1, 3, 4, init=True, D=True)
    leaves = [ins[k][:, 0].clone().requires_grad_() if k in ("x", "dt", "B", "C") else ins[k].clone().requires_grad_()
              for k in ("initial_state", "x", "dt", "A", "B", "C", "D")]
    s0, x, dt, A, B, C, D = leaves
    assert torch.autograd.gradcheck(lambda *t: ssd_step_torch(*t[:6], D=t[6]), leaves)


@needs_triton
@pytest.mark.parametrize("d_shape", ["h1", "h"])
def test_triton_step_d_one_per_head_as_h1(d_shape):
    """D (h, 1) is one skip per head, as on the torch step (the kernel read it with a channel stride of 1: 7e31 off)."""
    ins, _ = make_inputs(2, 1, 4, 2, 16, 16, dtype=torch.float32, D=True, init=True)
    dev, _ = on_triton_device(ins)
    D = dev["D"][:, None] if d_shape == "h1" else dev["D"]
    args = (dev["initial_state"], dev["x"][:, 0], dev["dt"][:, 0], dev["A"], dev["B"][:, 0], dev["C"][:, 0])
    y1, s1 = ssd_step(*args, D=D, backend="triton")
    y2, s2 = ssd_step_torch(*(a.double().cpu() for a in args), D=ins["D"].double())
    assert rel(y1, y2) < 1e-6 and rel(s1, s2) < 1e-6


@needs_triton
@pytest.mark.parametrize("normalize", [False, True])
def test_triton_step_passes_gradients(normalize):
    """With inputs that require grad, the Triton step's outputs carry the gradients of the torch step (they silently
    required none before)."""
    ins, _ = make_inputs(2, 1, 4, 2, 16, 16, dtype=torch.float32, normalize=normalize, D=True, init=True)
    names = ("initial_state", "x", "dt", "A", "B", "C", "D")
    gen = torch.Generator().manual_seed(4)

    def run(backend, dtype, device, needs):
        leaves = {k: ins[k].to(dtype).to(device).requires_grad_(k in needs) for k in names}
        pick = {k: leaves[k][:, 0] if k in ("x", "dt", "B", "C") else leaves[k] for k in names}
        y, s = ssd_step(pick["initial_state"], pick["x"], pick["dt"], pick["A"], pick["B"], pick["C"], D=pick["D"],
                        normalize=normalize, backend=backend)
        wrt = [leaves[k] for k in names if k in needs]
        return y, s, torch.autograd.grad((y.double() * gy.to(device)).sum() + (s.double() * gs.to(device)).sum(), wrt)

    gy = torch.randn(2, 4, 16, generator=gen, dtype=torch.float64)
    gs = torch.randn(2, 4, 16 + int(normalize), 16, generator=gen, dtype=torch.float64)
    for needs in (set(names), {"x", "A"}):
        y, s, grads = run("triton", torch.float32, on_triton_device({"x": ins["x"]})[0]["x"].device, needs)
        yr, sr, gr = run("torch", torch.float64, "cpu", needs)
        assert rel(y, yr) < 1e-5 and rel(s, sr) < 1e-5
        for a, r in zip(grads, gr):
            assert rel(a, r) < 1e-5
    dev, _ = on_triton_device(ins)  # (the GPU, or the CPU under the interpreter)
    with torch.no_grad():  # no autograd: the plain launch, outputs without grad
        y, _, = ssd_step(*(dev[k][:, 0] if k in ("x", "dt", "B", "C") else dev[k].clone().requires_grad_()
                           for k in names[:6]), D=dev["D"], normalize=normalize, backend="triton")
    assert not y.requires_grad
