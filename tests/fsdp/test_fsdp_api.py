"""``vescale.fsdp.fully_shard``'s upstream FSDP2 surface: the ``mesh=`` call returning an
``FSDPModule`` (unshard/reshard, gradient sync, reshard after backward, prefetch setters),
every buffer on the mesh's device, meta and ``deferred_init`` parameters (each rank holds
only its share), HSDP on a 2-D mesh, tied weights, DCP state dicts, the profiler's
``vescale.fsdp::`` ranges and no host read per step; each against one device (float64)."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator

import gpt
import pytest
import torch
import torch.distributed.checkpoint.state_dict as dcp_sd
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import vescale
from tests.harness.collectives import C10D_KINDS
from tests.harness.host_sync import count_host_syncs
from tests.harness.misuse import error_everywhere
from vescale.fsdp import FSDPModule, flat_group, fully_shard

CFG = gpt.GPTConfig(layers=2)
KINDS = {**C10D_KINDS, "c10d::allreduce_": "all_reduce"}


@contextlib.contextmanager
def count_collectives(kinds: dict[str, str]) -> Iterator[Counter[str]]:
    """The c10d collectives (``kinds``: profiler name -> kind) and the ``vescale.fsdp::``
    profiler ranges (by name) opened in the block."""
    counts: Counter[str] = Counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield counts
    raw = prof.profiler.kineto_results.events() if prof.profiler.kineto_results else []
    names = [e.name() for e in raw]
    counts.update(kinds[n] for n in names if n in kinds)
    counts.update(n for n in names if n.startswith("vescale.fsdp::"))


def _collectives(counts: Counter[str]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if not k.startswith("vescale.fsdp::")}


def _shard(model: nn.Module, mesh, **kwargs) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _dp() -> tuple[int, int]:
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _batch(step: int, dp_rank: int, dp_size: int):
    ids, targets = gpt.batch(CFG, step)
    n = ids.shape[0] // dp_size
    return (
        ids,
        targets,
        ids[dp_rank * n : (dp_rank + 1) * n],
        targets[dp_rank * n : (dp_rank + 1) * n],
    )


def _train_both(ref, model, steps, dp_rank, dp_size, make=None) -> None:
    make = make or (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1))
    _steps(
        ref, make(ref.parameters()), model, make(model.parameters()), range(steps), dp_rank, dp_size
    )


def _steps(ref, opt_ref, model, opt, steps, dp_rank, dp_size) -> None:
    """One device's steps on the whole batch, the sharded model's on its share."""
    for step in steps:
        ids, targets, my_ids, my_targets = _batch(step, dp_rank, dp_size)
        ref(ids, targets).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        model(my_ids, my_targets).backward()
        opt.step()
        opt.zero_grad()


def _assert_params_equal(ref, model) -> None:
    got = dict(model.named_parameters(remove_duplicate=False))
    for name, p_ref in ref.named_parameters(remove_duplicate=False):
        full = got[name].full_tensor()
        assert torch.allclose(full, p_ref, rtol=1e-10, atol=1e-12), name


# ---- devices ---------------------------------------------------------------------------

_FACTORIES = {torch.zeros, torch.empty, torch.ones, torch.full, torch.tensor, torch.arange}
_FSDP_DIR = vescale.fsdp.__file__.rsplit("/", 1)[0]


class _Allocations(TorchFunctionMode):
    """Every tensor factory called from ``vescale/fsdp/``: (function, its ``device=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _FACTORIES and sys._getframe(1).f_code.co_filename.startswith(_FSDP_DIR):
            self.calls.append((func.__name__, kwargs.get("device")))
        return func(*args, **kwargs)


def _buffers_on_mesh_device() -> None:
    rank, world = _dp()
    # a real step: every allocation in vescale/fsdp names the mesh's device
    mesh = vescale.init_device_mesh("cpu", (world,))
    seen = _Allocations()
    with seen:
        model = _shard(gpt.build(CFG).double(), mesh)
        _, _, ids, targets = _batch(0, rank, world)
        model(ids, targets).backward()
    assert {name for name, _ in seen.calls} >= {"zeros", "empty"}, seen.calls
    assert all(device == torch.device("cpu") for _, device in seen.calls), seen.calls


def test_every_buffer_on_the_mesh_device(pool2):
    pool2.run(_buffers_on_mesh_device)


# ---- meta and deferred parameters ----------------------------------------------------------


def _init(model: nn.Module) -> None:
    """A deterministic in-place init that runs on sharded parameters (LayerNorm's own
    ``reset_parameters``, a constant per parameter elsewhere)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(0.02 * ((i % 7) - 3))
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()


def _meta_init_vs_one_device() -> None:
    rank, world = _dp()
    mesh = vescale.init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = gpt.GPT(CFG).double()
    _shard(model, mesh)
    groups = [flat_group(m) for m in [*model.blocks, model]]
    assert all(g.shard.is_meta for g in groups)
    held = {id(p) for p in model.parameters()}
    model.to_empty(device="cpu")
    assert {id(p) for p in model.parameters()} == held  # the same parameter objects
    _init(model)
    for g in groups:  # each rank holds only its share, the parameters view it
        assert g.shard.device.type == "cpu" and g.shard.numel() == g.layout.share
        assert g.full.untyped_storage().nbytes() == 0
        for p in g.sharded:
            base = g.shard.untyped_storage().data_ptr()
            assert p.to_local().untyped_storage().data_ptr() == base
    ref = gpt.GPT(CFG).double()
    _init(ref)
    _assert_params_equal(ref, model)
    _train_both(ref, model, 2, rank, world)
    _assert_params_equal(ref, model)


def test_meta_parameters_to_empty_and_init(pool2):
    pool2.run(_meta_init_vs_one_device)


def _deferred_vs_one_device() -> None:
    rank, world = _dp()
    mesh = vescale.init_device_mesh("cpu", (world,))
    model = _shard(gpt.build_deferred(CFG), mesh)
    assert not vescale.is_deferred(model)
    for m in [*model.blocks, model]:
        g = flat_group(m)
        assert g.shard.numel() == g.layout.share
    ref = gpt.build(CFG)  # eager init from the same seed
    _assert_params_equal(ref, model)
    model.double()  # a module-wide cast re-views the new shard (the same parameters)
    ref.double()
    _train_both(ref, model, 2, rank, world)
    _assert_params_equal(ref, model)


def test_deferred_init_parameters_equal_eager_init(pool2):
    pool2.run(_deferred_vs_one_device)


# ---- FSDPModule ------------------------------------------------------------------------


def _module_methods() -> None:
    rank, world = _dp()
    mesh = vescale.init_device_mesh("cpu", (world,))
    ref, model = gpt.build(CFG).double(), _shard(gpt.build(CFG).double(), mesh)
    assert isinstance(model, FSDPModule) and isinstance(model, gpt.GPT)
    assert type(model).__name__ == "FSDPGPT"
    assert all(isinstance(b, FSDPModule) for b in model.blocks)
    ids, targets, my_ids, my_targets = _batch(0, rank, world)
    # unshard: the gather happens now, forward issues none for that module
    handle = model.blocks[0].unshard(async_op=True)
    handle.wait()
    model.unshard()
    with count_collectives(KINDS) as c, torch.no_grad():
        model(my_ids, my_targets)
    assert _collectives(c) == {"all_gather": len(model.blocks) - 1}  # root, block 0: done
    model.blocks[0].unshard()
    model.blocks[0].reshard()
    assert flat_group(model.blocks[0]).full.untyped_storage().nbytes() == 0
    # gradient accumulation without communication, then one synced backward
    model.set_requires_gradient_sync(False)
    with count_collectives(KINDS) as c:
        model(my_ids, my_targets).backward()
    assert "reduce_scatter" not in c and all(p.grad is None for p in model.parameters())
    ref(ids, targets).backward()
    model.set_requires_gradient_sync(True)
    ids, targets, my_ids, my_targets = _batch(1, rank, world)
    ref(ids, targets).backward()
    with count_collectives(KINDS) as c:
        model(my_ids, my_targets).backward()
    assert c["reduce_scatter"] == len(model.blocks) + 1
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad.full_tensor(), p_ref.grad, rtol=1e-10, atol=1e-12), name
    # reshard after backward off: the next forward gathers nothing
    model.set_reshard_after_backward(False)
    model(my_ids, my_targets).backward()
    with count_collectives(KINDS) as c, torch.no_grad():
        model(my_ids, my_targets)
    assert "all_gather" not in c
    model.set_reshard_after_backward(True)
    for m in [*model.blocks, model]:
        m.reshard()
    # reshard after forward off for the blocks: backward re-gathers nothing
    for b in model.blocks:
        b.set_reshard_after_forward(False)
    loss = model(my_ids, my_targets)
    with count_collectives(KINDS) as c:
        loss.backward()
    assert _collectives(c) == {"reduce_scatter": len(model.blocks) + 1}
    with pytest.raises(NotImplementedError, match=r"FSDPModule\.set_unshard_in_backward"):
        model.set_unshard_in_backward(False)


def test_fsdp_module_methods(pool2):
    pool2.run(_module_methods)


def _issued(module: nn.Module) -> bool:
    group = flat_group(module)
    return group._work is not None or group.full.untyped_storage().nbytes() > 0


def _explicit_prefetch() -> list[tuple[str, bool]]:
    """A first forward (no recorded order to prefetch from): the setters' modules' gathers
    are issued when the setting module's forward / backward begins."""
    rank, world = _dp()
    mesh = vescale.init_device_mesh("cpu", (world,))
    model = _shard(gpt.build(CFG).double(), mesh)
    first, last = model.blocks
    model.set_modules_to_forward_prefetch([last])
    last.set_modules_to_backward_prefetch([])  # not even the block before it
    seen = []
    first.register_forward_pre_hook(lambda m, _: seen.append(("forward", _issued(last))))

    def look(_grad):  # inside block 1's backward (its attention's output)
        seen.append(("backward", _issued(first)))

    last.attn.register_forward_hook(lambda m, args, out: out.register_hook(look) and None)
    _, _, ids, targets = _batch(0, rank, world)
    model(ids, targets).backward()
    return seen


def test_explicit_prefetch(pool2):
    for seen in pool2.run(_explicit_prefetch):
        assert seen == [("forward", True), ("backward", False)]


def _call_shapes() -> None:
    _, world = _dp()
    mesh = vescale.init_device_mesh("cpu", (world,))
    with pytest.warns(DeprecationWarning, match="pass mesh="):
        fully_shard(nn.Linear(4, 4), mesh)
    for bad in (0, 3, world * 2):
        with pytest.raises(ValueError, match=f"a factor of the shard world {world}; got {bad}"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=bad)
    with pytest.raises(TypeError, match=r"must be a bool, an int or None, got 2\.0"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=2.0)
    model = fully_shard(nn.Linear(4, 4).double())  # mesh=None: every rank
    assert flat_group(model).mesh.size() == world


def test_upstream_call_shapes(pool2):
    pool2.run(_call_shapes)


# ---- HSDP ------------------------------------------------------------------------------


def _hsdp_vs_one_device() -> dict[str, int]:
    rank, world = _dp()
    mesh = vescale.init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    ref, model = gpt.build(CFG).double(), _shard(gpt.build(CFG).double(), mesh)
    q = model.blocks[0].attn.q.weight
    assert isinstance(q.placements[0], vescale.Replicate)
    assert isinstance(q.placements[1], vescale.RaggedShard)
    _train_both(ref, model, 3, rank, world)  # each rank its own quarter of the batch
    _assert_params_equal(ref, model)
    _, _, ids, targets = _batch(0, rank, world)
    loss = model(ids, targets)
    with count_collectives(KINDS) as c:
        loss.backward()
    return _collectives(c)


def test_hsdp_equals_one_device(pool4):
    groups = CFG.layers + 1
    for counts in pool4.run(_hsdp_vs_one_device):
        # the blocks re-gathered (over the shard dim), one reduce-scatter and one
        # all-reduce (over the replicas) per module
        assert counts == {"all_gather": CFG.layers, "reduce_scatter": groups, "all_reduce": groups}


# ---- reshard_after_forward as an int ---------------------------------------------------


def _reshard_to_two(hsdp: bool) -> tuple[list[tuple[int, int]], int]:
    """Blocks resharded to groups of 2 after forward: training equals one device; returns
    the backward all-gathers (group size, elements each rank sends) and a block's buffer
    size."""
    rank, world = _dp()
    shape = (2, world // 2) if hsdp else (world,)
    mesh = vescale.init_device_mesh("cpu", shape)
    ref = gpt.build(CFG).double()
    model = gpt.build(CFG).double()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    _train_both(ref, model, 3, rank, world)
    _assert_params_equal(ref, model)
    _, _, ids, targets = _batch(0, rank, world)
    loss = model(ids, targets)
    block = flat_group(model.blocks[0])
    assert block.full.untyped_storage().nbytes() == 0  # resharded after forward
    gathers = []
    real = torch.distributed.all_gather_single

    def spy(out, inp, group=None, async_op=False):  # type: ignore[no-untyped-def]
        gathers.append((torch.distributed.get_world_size(group), inp.numel()))
        return real(out, inp, group=group, async_op=async_op)

    torch.distributed.all_gather_single = spy
    try:
        loss.backward()
    finally:
        torch.distributed.all_gather_single = real
    return gathers, block._full_numel


@pytest.mark.parametrize("hsdp", [False, True])
def test_reshard_after_forward_to_groups_of_two(pool4, hsdp):
    for gathers, full in pool4.run(_reshard_to_two, hsdp):
        # every block re-gathered over a group of 2, each rank sending half the buffer
        assert gathers == [(2, full // 2)] * CFG.layers


# ---- tied weights ----------------------------------------------------------------------


def _tie(model: nn.Module) -> nn.Module:
    model.head.weight = model.tok.weight
    return model


def _tied_vs_one_device() -> None:
    rank, world = _dp()
    mesh = vescale.init_device_mesh("cpu", (world,))
    ref, model = _tie(gpt.build(CFG).double()), _shard(_tie(gpt.build(CFG).double()), mesh)
    assert model.head.weight is model.tok.weight
    # SGD: AdamW would amplify the rounding noise of the key biases' zero gradients
    _train_both(ref, model, 3, rank, world, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    _assert_params_equal(ref, model)
    assert model.head.weight is model.tok.weight


def test_tied_weights_equal_one_device(pool2):
    pool2.run(_tied_vs_one_device)


def _tied_across_calls() -> None:
    mesh = vescale.init_device_mesh("cpu", (2,))
    model = _tie(gpt.build(CFG))
    fully_shard(model.tok, mesh=mesh)
    fully_shard(model, mesh=mesh)


def test_tied_across_fully_shard_calls_is_refused(pool2):
    err = error_everywhere(pool2, _tied_across_calls)
    assert "'head.weight' is tied to a parameter an inner fully_shard call took" in err.message


# ---- DCP state dicts -------------------------------------------------------------------


def _trained(mesh, steps: int):
    rank, world = _dp()
    make = lambda ps: torch.optim.AdamW(ps, lr=0.01)  # noqa: E731
    ref, model = gpt.build(CFG).double(), _shard(gpt.build(CFG).double(), mesh)
    opt_ref, opt = make(ref.parameters()), make(model.parameters())
    _steps(ref, opt_ref, model, opt, range(steps), rank, world)
    return ref, opt_ref, model, opt, make


def _state_dict_round_trip(hsdp: bool) -> None:
    rank, world = _dp()
    mesh = vescale.init_device_mesh("cpu", (2, world // 2) if hsdp else (world,))
    ref, opt_ref, model, opt, make = _trained(mesh, 2)
    model_sd = dcp_sd.get_model_state_dict(model)
    optim_sd = dcp_sd.get_optimizer_state_dict(model, opt)
    assert isinstance(model_sd["blocks.0.attn.q.weight"], vescale.DTensor)
    # a fresh sharded model (other weights) and optimizer take both state dicts
    fresh = _shard(gpt.build(CFG, seed=1).double(), mesh)
    fresh_opt = make(fresh.parameters())
    dcp_sd.set_model_state_dict(fresh, model_sd)
    dcp_sd.set_optimizer_state_dict(fresh, fresh_opt, optim_sd)
    _assert_params_equal(ref, fresh)
    # training goes on as one device's (AdamW's moments and step restored)
    _steps(ref, opt_ref, fresh, fresh_opt, range(2, 4), rank, world)
    _assert_params_equal(ref, fresh)


def test_dcp_state_dict_round_trip(pool2):
    pool2.run(_state_dict_round_trip, False)


def test_dcp_state_dict_round_trip_hsdp(pool4):
    pool4.run(_state_dict_round_trip, True)


def _full_state_dicts() -> None:
    _, world = _dp()
    mesh = vescale.init_device_mesh("cpu", (world,))
    ref, opt_ref, model, opt, _ = _trained(mesh, 2)
    full = dcp_sd.StateDictOptions(full_state_dict=True)
    pairs = [
        (dcp_sd.get_model_state_dict(model, options=full), ref.state_dict()),
        (
            dcp_sd.get_optimizer_state_dict(model, opt, options=full)["state"],
            dcp_sd.get_optimizer_state_dict(ref, opt_ref, options=full)["state"],
        ),
    ]
    for got, want in pairs:
        assert got.keys() == want.keys()
        flat_got, flat_want = tree_flatten(got)[0], tree_flatten(want)[0]
        for g, w in zip(flat_got, flat_want):
            assert type(g) is type(w) and not isinstance(g, vescale.DTensor)
            assert torch.allclose(g, w, rtol=1e-10, atol=1e-12) if torch.is_tensor(w) else g == w


def test_dcp_full_state_dicts_equal_one_device(pool2):
    pool2.run(_full_state_dicts)


# ---- profiler ranges and host reads ----------------------------------------------------


def _step_profile() -> tuple[Counter[str], int]:
    rank, world = _dp()
    mesh = vescale.init_device_mesh("cpu", (world,))
    model = _shard(gpt.build(CFG).double(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _, _, ids, targets = _batch(0, rank, world)
    model(ids, targets).backward()  # warm-up: records the forward order
    opt.step()
    opt.zero_grad()
    with count_collectives(KINDS) as counts, count_host_syncs() as reads:
        model(ids, targets).backward()
        opt.step()
        opt.zero_grad()
    return counts, len(reads.calls)


def test_profiler_ranges_collectives_and_no_host_read_per_step(pool2):
    groups = CFG.layers + 1
    for counts, reads in pool2.run(_step_profile):
        # forward gathers every module, backward re-gathers the blocks
        assert counts["vescale.fsdp::all_gather"] == groups + CFG.layers
        assert counts["vescale.fsdp::reduce_scatter"] == groups
        assert counts["vescale.fsdp::reduce_scatter_copy_in"] == groups
        assert _collectives(counts) == {"all_gather": groups + CFG.layers, "reduce_scatter": groups}
        assert reads == 0
