"""Op behaviour vescale adds to upstream's registry, one module per op family."""

from vescale.dtensor.ops import attention, comparison, data_dependent, loss

__all__ = ["attention", "comparison", "data_dependent", "loss"]
