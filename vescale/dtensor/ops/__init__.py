"""Op behaviour vescale adds to upstream's registry, one module per op family."""

from vescale.dtensor.ops import (
    arg_reduction,
    as_strided,
    attention,
    clone,
    comparison,
    data_dependent,
    embedding,
    gather,
    indexing,
    interleaved,
    loss,
    negative_dims,
    norm,
    norm_backward,
    ragged,
    view,
)

__all__ = [
    "arg_reduction",
    "as_strided",
    "attention",
    "clone",
    "comparison",
    "data_dependent",
    "embedding",
    "gather",
    "indexing",
    "interleaved",
    "loss",
    "negative_dims",
    "norm",
    "norm_backward",
    "ragged",
    "view",
]
