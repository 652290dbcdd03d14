"""veScale's functional API for DTensors (the names legacy veScale exposed here).

A facade for users and legacy code: the conversions are :mod:`vescale.dtensor.dtensor`'s,
beside the class they build; the collectives :mod:`vescale.dtensor._legacy`'s; ``wait_local``
:mod:`vescale.dtensor.inflight`'s. Code inside ``vescale`` imports them from those homes.
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
from vescale.dtensor.inflight import wait_local

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
