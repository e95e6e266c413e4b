"""compat.selective_state_update's state_batch_indices: an index outside [0, pool) is an error. A negative one was
taken as Python indexing takes it (-1: the pool's last row), so a padding slot of -1 silently overwrote another
sequence's state; mamba_ssm's kernel has no meaning for it either (it reads before the pool)."""

import pytest
import torch

from kernels.compat import selective_state_update


def _inputs(b=3, h=4, g=2, p=5, n=6, pool=5, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    return dict(x=rn(b, h, p), dt=rn(b, h, p), A=-(torch.rand(h, p, n, generator=gen, dtype=torch.float64) + 0.2),
                B=rn(b, g, n), C=rn(b, g, n)), rn(pool, h, p, n)


@pytest.mark.parametrize("idx", [[0, -1, 2], [0, 5, 1], [-5, 1, 2]])
def test_out_of_range_state_batch_indices_are_an_error_and_touch_nothing(idx):
    t, pool = _inputs()
    s = pool.clone()
    with pytest.raises((ValueError, RuntimeError), match="state_batch_indices"):
        selective_state_update(s, **t, state_batch_indices=torch.tensor(idx), backend="torch")
    assert torch.equal(s, pool)


def test_in_range_int32_indices_still_work():
    t, pool = _inputs()
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    s = pool.clone()
    y = selective_state_update(s, **t, state_batch_indices=idx, backend="torch")
    s2 = pool[idx.long()].clone()
    y2 = selective_state_update(s2, **t, backend="torch")
    assert torch.equal(y, y2) and torch.equal(s[idx.long()], s2)
    assert torch.equal(s[[1, 3]], pool[[1, 3]])
