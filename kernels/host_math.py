"""Integer helpers for the host side of the kernels' launches (grids, tile sizes).

Plain Python: Triton 3.9's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr-function wrappers that cost
several microseconds a call on the host, and one SSD forward+backward makes ~26 such calls.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-int(a) // int(b))


def next_pow2(v: int) -> int:
    """The smallest power of two >= v (1 for v <= 1)."""
    v = int(v)
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def is_pow2(v: int) -> bool:
    """Whether v is a positive power of two."""
    return v > 0 and not v & (v - 1)
