"""Op behaviour vescale adds to upstream's registry, one module per op family."""

from vescale.dtensor.ops import comparison, data_dependent

__all__ = ["comparison", "data_dependent"]
