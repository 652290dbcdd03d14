"""Data parallelism on DTensor models: gradients reduced to their parameters' placements."""

from vescale.ddp.distributed_data_parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
