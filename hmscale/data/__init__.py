"""Data: text sources (HF datasets, local files, the embedded stdlib corpus), tokenizer, packing, shard plan."""

from hmscale.data.bundle import DataBundle, prepare_data
from hmscale.data.plan import ShardPlan

__all__ = ["DataBundle", "ShardPlan", "prepare_data"]
