"""veScale's ``vescale.initialize``: deferred initialization and sharded materialization."""

from vescale.dtensor.deferred_init import (
    deferred_init,
    is_deferred,
    materialize_dtensor,
    materialize_module,
)

__all__ = ["deferred_init", "is_deferred", "materialize_dtensor", "materialize_module"]
