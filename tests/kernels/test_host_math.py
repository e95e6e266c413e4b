"""The host-side integer helpers agree with Triton's own cdiv / next_power_of_2 (which they replace for speed)."""

import triton

from kernels.host_math import cdiv, next_pow2


def test_cdiv_and_next_pow2_match_triton():
    for a in range(0, 600):
        for b in (1, 2, 3, 16, 63, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
        if a >= 1:
            assert next_pow2(a) == triton.next_power_of_2(a), a
    assert next_pow2(2 ** 20 + 1) == 2 ** 21 and cdiv(2 ** 40 + 1, 2 ** 20) == 2 ** 20 + 1
