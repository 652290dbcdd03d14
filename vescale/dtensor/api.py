"""veScale's functional API for DTensors (the names legacy veScale exposed here).

The conversions are :mod:`vescale.dtensor.dtensor`'s, beside the class they build; the
collectives are :mod:`vescale.dtensor._legacy`'s.
"""

from vescale.dtensor._legacy import (
    vescale_all_gather,
    vescale_all_reduce,
    vescale_reduce_scatter,
)
from vescale.dtensor.dtensor import (
    distribute_tensor,
    from_local,
    full_tensor,
    redistribute_dtensor,
    to_local,
)
from vescale.dtensor.redistribute import wait_local

__all__ = [
    "distribute_tensor",
    "from_local",
    "full_tensor",
    "redistribute_dtensor",
    "to_local",
    "vescale_all_gather",
    "vescale_all_reduce",
    "vescale_reduce_scatter",
    "wait_local",
]
