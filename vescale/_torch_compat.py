"""Every private upstream symbol vescale depends on, imported in one place.

A torch upgrade that moves or renames one of these fails here, loudly, and
``tests/test_torch_compat.py`` pins the shapes we rely on. Private attributes read elsewhere
are listed in ``PRIVATE_ATTRIBUTES``; ``tests/test_torch_private_names.py`` reads the package
for private torch names and fails on any missing here.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import _COMPILER_FNS as DYNAMO_COMPILER_FNS
from torch._dynamo.backends.registry import register_backend
from torch._export.utils import _compiling_state_context as export_tracing_state
from torch._functorch.aot_autograd import make_boxed_func
from torch._guards import TracingContext, tracing
from torch._library.opaque_object import MemberType, register_opaque_type
from torch._logging import trace_structured
from torch._prims.rng_prims import run_dtensor_rng_op
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._functional_collectives import _are_we_tracing as are_we_tracing
from torch.distributed._local_tensor import _for_each_rank_run_func as for_each_rank_run
from torch.distributed._local_tensor import enabled_local_tensor_mode, maybe_run_for_local_tensor
from torch.distributed.device_mesh import _mesh_resources
from torch.distributed.distributed_c10d import _get_default_store as default_store
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
from torch.distributed.distributed_c10d import _set_pg_timeout as set_pg_timeout
from torch.distributed.tensor import DTensor as _UpstreamDTensor
from torch.distributed.tensor import _dispatch as upstream_dispatch_module
from torch.distributed.tensor._collective_utils import mesh_scatter, redistribute_cost
from torch.distributed.tensor._dispatch import OpDispatcher
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpInfo,
    OpSchema,
    OpSpec,
    OpStrategy,
    OutputSharding,
    TupleStrategy,
)
from torch.distributed.tensor._ops import utils as upstream_strategy_utils
from torch.distributed.tensor._ops.single_dim_strategy import _PreparedSingleDimStrategy
from torch.distributed.tensor._ops.utils import (
    expand_to_full_mesh_op_strategy,
)
from torch.distributed.tensor._ops.utils import (
    register_op_strategy as upstream_register_op_strategy,
)
from torch.distributed.tensor._random import _calc_shard_info as shard_info
from torch.distributed.tensor._random import _calc_shard_linear_idx as shard_linear_idx
from torch.distributed.tensor._random import _PhiloxState as PhiloxState
from torch.distributed.tensor._redistribute import (
    _gen_transform_infos as gen_transform_infos,
)
from torch.distributed.tensor._redistribute import (
    redistribute_local_tensor as upstream_redistribute_local_tensor,
)
from torch.distributed.tensor._sharding_prop import LocalLRUCache
from torch.distributed.tensor._utils import (
    ExplicitRedistributionContext,
    _compute_local_shape_and_global_offset,
    compute_global_tensor_info,
    compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.parallel import loss as upstream_loss_module
from torch.distributed.tensor.placement_types import _MaskPartial as MaskPartial
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.optim.optimizer import _global_optimizer_pre_hooks as global_optimizer_pre_hooks
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    return_and_correct_aliasing,
)
from torch.utils._pytree import tree_map

__all__ = [
    "DYNAMO_COMPILER_FNS",
    "PROPAGATOR",
    "AsyncCollectiveTensor",
    "DTensorSpec",
    "ExplicitRedistributionContext",
    "FakeTensorMode",
    "FunctionalTensor",
    "LocalLRUCache",
    "MaskPartial",
    "MemberType",
    "OpDispatcher",
    "OpInfo",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "OutputSharding",
    "PhiloxState",
    "PreparedSingleDimStrategy",
    "StridedShard",
    "TensorMeta",
    "TorchDispatchMode",
    "TracingContext",
    "TupleStrategy",
    "_mesh_resources",
    "aot_autograd",
    "are_we_tracing",
    "bucket_merge_fns",
    "compute_global_tensor_info",
    "compute_local_shape_and_global_offset",
    "compute_local_shape_at",
    "current_autograd_node",
    "current_graph_task_id",
    "current_graph_task_keep_graph",
    "default_store",
    "disable_current_modes",
    "enabled_local_tensor_mode",
    "expand_to_full_mesh_op_strategy",
    "export_tracing_state",
    "for_each_rank_run",
    "from_functional_tensor",
    "gen_transform_infos",
    "get_proxy_mode",
    "get_proxy_slot",
    "global_optimizer_pre_hooks",
    "group_timeout",
    "has_cpu_backend",
    "inductor_cache_key",
    "inductor_compile_fx",
    "inductor_config_names",
    "inductor_config_patches",
    "inductor_inner",
    "inductor_mode_options",
    "load_inductor_graph",
    "make_boxed_func",
    "maybe_run_for_local_tensor",
    "mesh_scatter",
    "nccl_tuning",
    "plain_aot_forward",
    "pytree",
    "redistribute_cost",
    "register_backend",
    "register_opaque_type",
    "resolve_process_group",
    "return_and_correct_aliasing",
    "run_dtensor_rng_op",
    "set_pg_timeout",
    "shard_info",
    "shard_linear_idx",
    "stable_topological_sort",
    "trace_structured",
    "tracing",
    "tree_map",
    "upstream_dispatch_module",
    "upstream_loss_module",
    "upstream_redistribute_local_tensor",
    "upstream_register_op_strategy",
    "upstream_strategy_utils",
]

PROPAGATOR = _UpstreamDTensor._op_dispatcher.sharding_propagator
"""Upstream's one sharding propagator (its strategy tables hold vescale's strategies too)."""

from_functional_tensor = torch._from_functional_tensor
PreparedSingleDimStrategy = _PreparedSingleDimStrategy
disable_current_modes = _disable_current_modes

current_graph_task_keep_graph = torch._C._autograd._get_current_graph_task_keep_graph
current_autograd_node = torch._C._current_autograd_node  # the autograd Node running now, or None
current_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass
"""Inside a backward: whether the running graph task retains the graph (``retain_graph``)."""


def compute_local_shape_at(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> tuple[int, ...]:
    """The local shape of the shard at mesh ``coordinate`` (any rank's, not only this one's)."""
    shape, _ = _compute_local_shape_and_global_offset(
        list(global_shape), list(mesh_shape), list(coordinate), placements, skip_offset=True
    )
    return tuple(int(s) for s in shape)


def has_cpu_backend(group: Any) -> bool:
    """Whether ``group`` runs collectives of CPU tensors (gloo, or ``"cuda:nccl,cpu:gloo"``)."""
    return torch.device("cpu") in group._device_types


def group_timeout(group: Any) -> Any:
    """The timeout (``timedelta``) of ``group``'s backend for its first device type."""
    return group._get_backend(group._device_types[0]).options._timeout


def bucket_merge_fns() -> dict[str, Any]:
    """Inductor's FX rewrites merging a bucket of collectives into one, by kind."""
    from torch._inductor.fx_passes.bucketing import (
        merge_all_gather_bucket,
        merge_all_reduce_bucket,
        merge_reduce_scatter_bucket,
    )

    return {
        "all_reduce": merge_all_reduce_bucket,
        "all_gather": merge_all_gather_bucket,
        "reduce_scatter": merge_reduce_scatter_bucket,
    }


def nccl_tuning() -> dict[str, Any]:
    """NCCL's tuning constants as Inductor's ``comm_analysis`` carries them (from NCCL's
    ``tuning.cc`` and ``topo.h``): latencies in us ``base_lat[algo][proto]``,
    ``hw_lat[hw][algo][proto]``, LL's bus-bandwidth cap ``ll_max_bw[generation][nodes index]``,
    ring LL128's per channel ``ll128_channel_bw[generation][nodes index]``, ``channels`` per
    generation,
    the index enums ``hw``, ``algo``, ``proto``, ``generation`` and the bus bandwidths (GB/s)
    by generation ``nvlink_bw``, ``inter_node_bw``. Imported on first use (Inductor)."""
    from torch._inductor import comm_analysis as ca

    return {
        "base_lat": ca.baseLat,
        "hw_lat": ca.hwLat,
        "ll_max_bw": ca.llMaxBws,
        "ll128_channel_bw": ca.perChMaxRingLL128Bws,
        "channels": ca._GPU_NCHANNELS,
        "hw": ca.NCCL_HW,
        "algo": ca.NCCL_ALGO,
        "proto": ca.NCCL_PROTO,
        "generation": ca.NVIDIA_GPU_TYPE,
        "nvlink_bw": ca._GPU_NVLINK_BW,
        "inter_node_bw": ca._GPU_INTER_NODE_BW,
    }


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Inductor's in-place topological sort that keeps the existing order where it can."""
    from torch._inductor.pattern_matcher import stable_topological_sort as sort

    sort(graph)


def inductor_compile_fx(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    inner_compile: Any,
    config_patches: dict[str, Any],
) -> Any:
    """Inductor's ``compile_fx`` (pre-grad passes, decompositions, joint-graph passes and
    partition, each graph's ``compile_fx_inner`` keywords: static inputs, CUDA graphs, graph
    id, device index, inference/backward) as ``backend="inductor"`` runs it under
    ``config_patches``, with ``inner_compile`` called in place of ``compile_fx_inner`` and
    AOTAutograd's cache off (its key holds neither ``inner_compile`` nor what it does)."""
    from torch._functorch import config as aot_config
    from torch._inductor.compile_fx import compile_fx

    with aot_config.patch(enable_autograd_cache=False):
        return compile_fx(
            gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches
        )


def inductor_inner() -> Any:
    """Inductor's ``compile_fx_inner``, imported on first use: importing Inductor costs
    seconds."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner


def inductor_mode_options() -> dict[str, dict[str, Any]]:
    """``torch.compile``'s modes and the Inductor config patches each stands for."""
    from torch._inductor import list_mode_options

    return {m: list_mode_options(m) for m in list_mode_options()}


def inductor_config_names() -> list[str]:
    """The names of Inductor's config options (dotted for nested ones: ``triton.cudagraphs``)."""
    from torch._inductor import config

    return sorted(config.get_config_copy())


def inductor_config_patches(mode: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """Inductor's config patches of ``torch.compile(backend="inductor", mode=mode,
    options=options)``, merged as torch merges them (the mode's, then ``options`` over
    them, ``-`` in names read as ``_``); ``RuntimeError`` (torch's) for an unknown name or a
    value not of the option's type."""
    return dict(torch._TorchCompileInductorWrapper(mode, options, None).config)


def inductor_cache_key(compiled: Any) -> tuple[str, list[str]] | None:
    """(FX graph cache key, its debug lines) of a ``compile_fx_inner`` output; ``None`` when
    Inductor bypassed its cache (nothing was stored to load later)."""
    key = getattr(compiled, "_fx_graph_cache_key", None)
    if key is None:
        return None
    return key, list(getattr(compiled, "_fx_graph_cache_debug_lines", None) or [])


def plain_aot_forward() -> bool:
    """Inside an AOTAutograd forward compiler: whether AOTAutograd wraps the compiled forward
    in nothing but a call (no mutated input, no output that aliases an input or another
    output, no effect tokens, no RNG state, no tensor subclass), so the compiled graph called
    on the same inputs is the whole step."""
    from torch._functorch._aot_autograd.schemas import OutputType, PlainTensorMeta

    context = TracingContext.try_get()
    meta = None if context is None else context.fw_metadata
    return bool(
        meta is not None
        and not meta.mutated_inp_runtime_indices
        and all(o.output_type == OutputType.non_alias for o in meta.output_info)
        and meta.num_intermediate_bases == 0
        and not meta.tokens
        and meta.num_graphsafe_rng_states == 0
        and meta.subclass_inp_meta is not None
        and all(isinstance(m, int | PlainTensorMeta) for m in meta.subclass_inp_meta)
    )


def load_inductor_graph(key: str, debug_lines: list[str], examples: Sequence[Any]) -> Any | None:
    """The graph Inductor compiled and stored in its FX graph cache under ``key`` (a
    ``compile_fx_inner`` output's ``_fx_graph_cache_key``), post-compiled as
    ``compile_fx_inner`` with its default keywords would return it (boxed: called with a list
    of tensors); ``None`` when the cache no longer holds it. ``examples``: fake inputs of a mode
    with a shape env, inside a tracing context."""
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.compile_fx import _CompileFxKwargs
    from torch._inductor.output_code import CompiledFxGraphConstants
    from torch._inductor.utils import BoxedBool

    constants = CompiledFxGraphConstants()
    graph, _ = FxGraphCache.load_with_key(
        key, debug_lines, examples, True, None, is_backward=False, constants=constants
    )
    if graph is None:
        return None
    kwargs: _CompileFxKwargs = {
        "cudagraphs": BoxedBool(False),
        "static_input_idxs": (),
        "is_backward": False,
        "graph_id": None,
        "cpp_wrapper": False,
        "fx_wrapper": False,
        "is_inference": False,
        "boxed_forward_device_index": None,
        "layout_opt": None,
        "extern_node_serializer": None,
    }
    graph.post_compile(examples, constants, kwargs)
    return graph


# Private attributes (not importable names) we read or set:
#   DeviceMesh._dim_group_names, DeviceMesh._pg_registry   (mesh from an existing group)
#   DeviceMesh.__init__(..., _init_backend=False, _rank=...) (meta meshes, sub-meshes)
#   DeviceMesh._sym_get_coordinate                         (per-rank coordinate, LocalTensorMode)
#   _mesh_resources.num_devices_per_host                   (cost model on meta meshes)
#   torch.distributed.tensor._dispatch.redistribute_local_tensor
#                                                          (implicit redistribution to Partial)
#   OpDispatcher._custom_op_handlers, unwrap_to_op_info, sharding_propagator.propagate,
#     _dispatch_get_local_results_slow_path, _dispatch_fast_path_python_tail
#                                                          (per-op hooks, Python dispatch)
#   ExplicitRedistributionContext.observe_redistribution   (explicit-redistribution mode)
#   ShardingPropagator.propagate_op_sharding(_non_cached)   (errors naming op, placements, mesh)
#   ShardingPropagator.op_strategy_funcs, op_single_dim_strategy_funcs, op_to_schema_info
#                                                          (wrap / restore upstream strategies)
#   ShardingPropagator.op_to_scalar_shape_adjuster         (local split sizes / slice bounds)
#   OpDispatcher.wrap                                        (op outputs become vescale.DTensor)
#   DTensor._local_tensor, DTensor._spec                     (the DTensor payload)
#   DTensor._op_dispatcher                                   (the one dispatcher and propagator)
#   ShardingPropagator._propagate_tensor_meta_non_cached,
#     op_to_schema_info_for_single_dim_strategy             (output metas; upstream rules' info)
#   DeviceMesh._get_root_mesh, _is_current_rank_part_of_mesh, _hash, __init__(_init_backend=)
#                                                          (flattening, off-mesh ranks, pickling)
#   DTensorSpec._hash_impl, _hash_key, _stable_hash, _check_equals, _hash,
#     shallow_copy_with_tensor_meta                         (VescaleSpec: keys kept apart)
#   OpSchema._recompute_comparison_key                      (schemas edited before propagation)
#   OpOverload._schema, FunctionSchema._is_view_op         (op arguments by name; views)
#   Tensor._make_wrapper_subclass, torch._C._disabled_torch_function_impl,
#     nn.Module._parameters / _buffers                      (deferred init's fake tensors)
#   nn.Module._apply                                         (vescale.fsdp: to_empty/casts on
#                                                             the flat shard, as FSDP2's)
#   Variable._execution_engine, torch._C._current_graph_task_id
#                                                          (DDP's end-of-backward callback; one
#                                                           explicit-mode check per backward)
#   torch._C._clear_DTensor_sharding_propagator_cache      (caches dropped on install/uninstall)
#   Library._destroy                                        (the seam's op libraries undone)
#   make_boxed_func's _boxed_call                           (AOTAutograd's boxed convention)
#   _NormPartial._partition_value, _pre_reduce_transform, _post_reduce_transform
#                                                          (ExtremumNormPartial overrides them)
#   torch._C, torch._ops (OpOverload), torch._unique2, c10d._get_group_tag,
#     _math_ops._NormPartial                                (modules and functions read directly)
PRIVATE_ATTRIBUTES = (
    ("DeviceMesh", "_dim_group_names"),
    ("DeviceMesh", "_flatten"),
    ("DeviceMesh", "_pg_registry"),
    ("DeviceMesh", "_rank"),
    ("DeviceMesh", "_sym_get_coordinate"),
    ("_mesh_resources", "num_devices_per_host"),
    ("upstream_dispatch_module", "redistribute_local_tensor"),
    ("upstream_loss_module", "_disable_custom_loss_ops"),
    ("upstream_loss_module", "customized_loss_ops"),
    ("OpDispatcher", "wrap"),
    ("OpDispatcher", "unwrap_to_op_info"),
    ("OpDispatcher", "_dispatch_get_local_results_slow_path"),
    ("OpDispatcher", "_dispatch_fast_path_python_tail"),
    ("OpDispatcher", "_custom_op_handlers"),
    ("ExplicitRedistributionContext", "observe_redistribution"),
    ("ShardingPropagator", "propagate_op_sharding"),
    ("ShardingPropagator", "propagate_op_sharding_non_cached"),
    ("ShardingPropagator", "op_strategy_funcs"),
    ("ShardingPropagator", "op_single_dim_strategy_funcs"),
    ("ShardingPropagator", "op_to_schema_info"),
    ("ShardingPropagator", "op_to_scalar_shape_adjuster"),
    ("DTensor", "_local_tensor"),
    ("DTensor", "_spec"),
    ("DTensor", "_op_dispatcher"),
    ("ShardingPropagator", "_propagate_tensor_meta_non_cached"),
    ("ShardingPropagator", "op_to_schema_info_for_single_dim_strategy"),
    ("DeviceMesh", "_get_root_mesh"),
    ("DeviceMesh", "_is_current_rank_part_of_mesh"),
    ("DeviceMesh", "_hash"),
    ("DeviceMesh", "_init_backend"),
    ("DTensorSpec", "_hash_impl"),
    ("DTensorSpec", "_hash_key"),
    ("DTensorSpec", "_stable_hash"),
    ("DTensorSpec", "_check_equals"),
    ("DTensorSpec", "_hash"),
    ("DTensorSpec", "shallow_copy_with_tensor_meta"),
    ("OpSchema", "_recompute_comparison_key"),
    ("OpOverload", "_schema"),
    ("FunctionSchema", "_is_view_op"),
    ("Tensor", "_make_wrapper_subclass"),
    ("Module", "_parameters"),
    ("Module", "_buffers"),
    ("Module", "_apply"),
    ("Variable", "_execution_engine"),
    ("Library", "_destroy"),
    ("make_boxed_func", "_boxed_call"),
    ("torch", "_C"),
    ("torch", "_ops"),
    ("torch", "_unique2"),
    ("torch._C", "_clear_DTensor_sharding_propagator_cache"),
    ("torch._C", "_current_graph_task_id"),
    ("torch._C", "_disabled_torch_function_impl"),
    ("torch.distributed.distributed_c10d", "_get_group_tag"),
    ("torch.distributed.tensor._ops", "_math_ops"),
    ("torch.distributed.tensor._ops._math_ops", "_NormPartial"),
    ("NormPartial", "_partition_value"),
    ("NormPartial", "_pre_reduce_transform"),
    ("NormPartial", "_post_reduce_transform"),
)
