"""The eager layer: ``vescale.DTensor`` on top of ``torch.distributed.tensor``."""

from vescale.dtensor.device_mesh import DeviceMesh, init_device_mesh
from vescale.dtensor.dtensor import (
    DTensor,
    distribute_tensor,
    from_local,
    full_tensor,
    redistribute_dtensor,
    to_local,
)
from vescale.dtensor.placement_types import (
    InterleavedShard,
    Partial,
    Placement,
    RaggedShard,
    Replicate,
    Shard,
)

__all__ = [
    "DTensor",
    "DeviceMesh",
    "InterleavedShard",
    "Partial",
    "Placement",
    "RaggedShard",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "from_local",
    "full_tensor",
    "init_device_mesh",
    "redistribute_dtensor",
    "to_local",
]

from vescale.dtensor import ops  # noqa: F401  (registers vescale op behaviour)
from vescale.dtensor._utils import allclose, equal
from vescale.dtensor.explicit import explicit_redistribute
from vescale.dtensor.factory import arange, empty, full, ones, rand, randn, zeros

__all__ += [
    "allclose",
    "arange",
    "empty",
    "equal",
    "explicit_redistribute",
    "full",
    "ones",
    "rand",
    "randn",
    "zeros",
]
