"""The public dispatch extension points, gathered: op behaviour declared in the one op
registry (:mod:`vescale.dtensor.ops._registry`, whose docstring says which declaration to
use when: strategies, rules, dispatch hooks under their public and veScale legacy names),
explicit mode (:mod:`vescale.dtensor.explicit`) and plug-in kernels
(:mod:`vescale.dtensor.plugin`)."""

from vescale.dtensor.explicit import (
    ImplicitRedistributionError,
    explicit_redistribute,
)
from vescale.dtensor.hooks import (
    _bypass_for_dispatch,
    _bypass_for_sharding_prop,
    _post_patch_for_dispatch,
    _pre_patch_for_dispatch,
    bypass_dispatch,
    bypass_sharding_prop,
    post_dispatch_patch,
    pre_dispatch_patch,
    unregister_bypass_dispatch,
    unregister_bypass_sharding_prop,
    unregister_post_dispatch_patch,
    unregister_pre_dispatch_patch,
)
from vescale.dtensor.ops._registry import register_rule, register_strategy
from vescale.dtensor.ops._registry import register_rule as vescale_propagation_rule
from vescale.dtensor.plugin import plugin_op
from vescale.dtensor.propagation import UnsupportedOpError

__all__ = [
    "ImplicitRedistributionError",
    "UnsupportedOpError",
    "_bypass_for_dispatch",
    "_bypass_for_sharding_prop",
    "_post_patch_for_dispatch",
    "_pre_patch_for_dispatch",
    "bypass_dispatch",
    "bypass_sharding_prop",
    "explicit_redistribute",
    "plugin_op",
    "post_dispatch_patch",
    "pre_dispatch_patch",
    "register_rule",
    "register_strategy",
    "unregister_bypass_dispatch",
    "unregister_bypass_sharding_prop",
    "unregister_post_dispatch_patch",
    "unregister_pre_dispatch_patch",
    "vescale_propagation_rule",
]
