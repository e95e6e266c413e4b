"""A dp x tp process-group mesh over ``torch.distributed``.

Ranks are laid out tp-fastest: tensor-parallel groups are runs of consecutive ranks
(``[0..tp-1], [tp..2tp-1], ...``, so they stay inside a node), data-parallel groups take one rank
from each tp group (``[j, j+tp, j+2tp, ...]``). Without an initialised process group, or with one
process, the mesh is trivial (tp = dp = 1, no groups) and every parallel layer is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["ParallelMesh", "build_mesh", "trivial_mesh"]


@dataclass
class ParallelMesh:
    world_size: int
    rank: int
    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    tp_group: object = None  # ProcessGroup or None (trivial)
    dp_group: object = None
    tp_ranks: list[int] = field(default_factory=lambda: [0])
    dp_ranks: list[int] = field(default_factory=lambda: [0])

    @property
    def tp(self) -> int:
        return self.tp_size

    @property
    def dp(self) -> int:
        return self.dp_size

    def __repr__(self) -> str:
        return (f"ParallelMesh(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size} {self.tp_ranks}, "
                f"dp={self.dp_rank}/{self.dp_size} {self.dp_ranks})")


def trivial_mesh() -> ParallelMesh:
    return ParallelMesh(world_size=1, rank=0, tp_size=1, dp_size=1, tp_rank=0, dp_rank=0)


def build_mesh(tp: int = 1) -> ParallelMesh:
    """Create the tp and dp groups (collective: every rank must call it, with the same ``tp``)."""
    if tp < 1:
        raise ValueError(f"parallel.tp: {tp} must be >= 1")
    if not (dist.is_available() and dist.is_initialized()):
        if tp != 1:
            raise ValueError(f"parallel.tp: {tp} needs an initialised torch.distributed process group with a multiple of {tp} ranks")
        return trivial_mesh()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"parallel.tp: {tp} does not divide the world size {world}; pick a divisor of {world}")
    dp = world // tp
    tp_group = dp_group = None
    tp_ranks = dp_ranks = None
    # every rank creates every group, in the same order (torch.distributed requires it)
    for i in range(dp):
        ranks = list(range(i * tp, (i + 1) * tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group, tp_ranks = g, ranks
    for j in range(tp):
        ranks = list(range(j, world, tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group, dp_ranks = g, ranks
    return ParallelMesh(world_size=world, rank=rank, tp_size=tp, dp_size=dp, tp_rank=rank % tp, dp_rank=rank // tp,
                        tp_group=tp_group, dp_group=dp_group, tp_ranks=tp_ranks, dp_ranks=dp_ranks)
