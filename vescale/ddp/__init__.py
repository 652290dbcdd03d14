"""Data parallelism: DTensor gradients in their parameters' placements, plain ones averaged."""

from vescale.ddp.distributed_data_parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
