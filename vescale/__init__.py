"""vescale: PyTorch-native distributed tensors and an SPMD compiler backend.

Importing ``vescale`` registers the ``vescale`` torch.compile backend and installs
``vescale._patches`` (the one table of changes to torch objects; each scoped to vescale
DTensors or listed in ``docs/torch-changes.md``).
"""

from vescale import _patches, finite, fsdp
from vescale import backend as _backend
from vescale.dtensor import (
    DeviceMesh,
    DTensor,
    InterleavedShard,
    Partial,
    Placement,
    RaggedShard,
    Replicate,
    Shard,
    distribute_tensor,
    from_local,
    init_device_mesh,
    redistribute_dtensor,
    to_local,
)
from vescale.dtensor.deferred_init import (
    deferred_init,
    is_deferred,
    materialize_dtensor,
    materialize_module,
)
from vescale.finite import NonFiniteError, check_finite
from vescale.plan import parallelize
from vescale.profile import profile_step

__version__ = "0.1.0"

__all__ = [
    "DTensor",
    "DeviceMesh",
    "InterleavedShard",
    "NonFiniteError",
    "Partial",
    "Placement",
    "RaggedShard",
    "Replicate",
    "Shard",
    "__version__",
    "check_finite",
    "deferred_init",
    "distribute_tensor",
    "from_local",
    "fsdp",
    "init_device_mesh",
    "is_deferred",
    "materialize_dtensor",
    "materialize_module",
    "parallelize",
    "profile_step",
    "redistribute_dtensor",
    "to_local",
]

_patches.install()
_backend.register()
finite.from_env()
