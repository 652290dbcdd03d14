"""``vescale.DeviceMesh``: upstream ``DeviceMesh`` plus ``pg=``, meta meshes and sub-mesh splits."""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as _UpstreamDeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _upstream_init_device_mesh

from vescale import _watchdog
from vescale._torch_compat import _mesh_resources, disable_current_modes, set_pg_timeout
from vescale.dtensor.explicit_env import agree_env_state
from vescale.dtensor.flat_groups import flatten_mesh_dims, flattened_meshes

__all__ = ["DeviceMesh", "as_vescale_mesh", "init_device_mesh", "known_meshes"]

_meshes: list[tuple[weakref.ref[Any], Any]] = []  # (mesh, the world it was built in)


def _world() -> Any:
    return dist.group.WORLD if dist.is_initialized() else None


def register_mesh(mesh: Any) -> None:
    """Remember ``mesh`` (weakly) so reports can name the mesh dim of a process group."""
    _meshes[:] = [(r, w) for r, w in _meshes if r() is not None]
    _meshes.append((weakref.ref(mesh), _world()))
    if mesh.device_type != "meta":
        _watchdog.start()


def known_meshes() -> list[Any]:
    """Every live vescale mesh of the current process-group world (a mesh built before
    ``destroy_process_group`` may name groups whose names the new world reuses)."""
    world = _world()
    return [m for r, w in _meshes if w is world and (m := r()) is not None]


class DeviceMesh(_UpstreamDeviceMesh):
    """A device mesh. Accepts everything upstream does, plus:

    * ``DeviceMesh(device_type, pg=group)``: a 1-D mesh over an existing process group's
      ranks (no new group is created); with ``mesh`` too, both must list the same ranks.
    * ``device_type="meta"``: a shape-only mesh for planning; no process group is needed
      or created.
    * veScale legacy's keywords: ``_init_process_groups=False`` is upstream's
      ``_init_backend=False`` (no process groups; collectives on the mesh then fail);
      ``_validate_mesh`` (default True) checks, locally, that ranks are unique and fit the world.
    """

    def __init__(
        self,
        device_type: str,
        mesh: Any = None,
        *,
        mesh_dim_names: tuple[str, ...] | None = None,
        pg: dist.ProcessGroup | None = None,
        _validate_mesh: bool = True,
        _init_process_groups: bool = True,
        **upstream_kwargs: Any,
    ) -> None:
        if not _init_process_groups:
            upstream_kwargs.setdefault("_init_backend", False)
        if upstream_kwargs.get("_init_backend", True):
            check_device_type(device_type, "DeviceMesh")
        if pg is not None:
            ranks = dist.get_process_group_ranks(pg)
            if mesh is not None:
                given = torch.as_tensor(mesh).flatten().tolist()
                if given != ranks:
                    raise ValueError(
                        f"DeviceMesh: mesh {given} and process group ranks {ranks} differ; "
                        f"they must have the same content"
                    )
            super().__init__(
                device_type,
                torch.tensor(ranks, dtype=torch.int),
                mesh_dim_names=mesh_dim_names,
                _init_backend=False,
            )
            self._dim_group_names = [pg.group_name]
            self._pg_registry[pg.group_name] = pg
            register_mesh(self)
            return
        if mesh is None and not upstream_kwargs:
            raise ValueError("DeviceMesh: mesh or pg must be provided! (pass mesh=, pg=, or both)")
        if _validate_mesh and mesh is not None:
            _check_ranks(device_type, mesh)
        if device_type == "meta":
            upstream_kwargs.setdefault("_init_backend", False)
            upstream_kwargs.setdefault("_rank", dist.get_rank() if dist.is_initialized() else 0)
        user_world = _world()
        super().__init__(device_type, mesh, mesh_dim_names=mesh_dim_names, **upstream_kwargs)
        if upstream_kwargs.get("_init_backend", True):
            _set_timeouts(self, _watchdog.timeout(), user_world)
        register_mesh(self)
        if upstream_kwargs.get("_init_backend", True):
            agree_env_state()  # made its groups, collectively over the world

    def get_dim_groups(
        self, mesh_dim: int | None = None
    ) -> dist.ProcessGroup | list[dist.ProcessGroup]:
        """veScale legacy's name: the process group of ``mesh_dim``, or of every mesh dim."""
        if not getattr(self, "_dim_group_names", None):
            raise RuntimeError(f"DeviceMesh process groups not initialized! ({self})")
        if mesh_dim is None:
            return [self.get_group(i) for i in range(self.ndim)]
        return self.get_group(mesh_dim)

    @property
    def _dim_group_infos(self) -> list[tuple[str, list[int], str]]:
        """veScale legacy's per-mesh-dim ``(tag, ranks, group name)`` of this rank's groups."""
        groups = self.get_dim_groups() if getattr(self, "_dim_group_names", None) else []
        return [
            (dist.distributed_c10d._get_group_tag(g), dist.get_process_group_ranks(g), g.group_name)
            for g in groups  # type: ignore[union-attr]
        ]

    def __getstate__(self) -> dict[str, Any]:
        """Upstream's pickled state without the cached ``hash()``, which is salted per process
        (recomputed on demand): Inductor's FX graph cache pickles graph inputs, meshes among
        them, into its key, so with it no other process ever hit the cache."""
        state: dict[str, Any] = super().__getstate__()
        state.pop("_hash", None)
        return state

    def __repr__(self) -> str:
        """Upstream's text plus the rank list (in mesh order), so two meshes over the same
        ranks in a different order print apart; over 64 ranks, the first and last 8."""
        text = super().__repr__()
        if ", Mesh: " in text:  # TORCH_DISTRIBUTED_DEBUG=DETAIL prints the ranks already
            return text
        with disable_current_modes():  # printed inside a trace too (an error's text)
            mesh = self.mesh
            ranks = str(mesh.tolist())
            flat = [str(r) for r in mesh.flatten().tolist()]
        if len(flat) > 64:
            ranks = f"[{', '.join(flat[:8])}, ..., {', '.join(flat[-8:])}] ({len(flat)} ranks)"
        return f"{text[:-1]}, ranks={ranks})"

    def size(self, mesh_dim: int | None = None, *, dim: int | None = None) -> int:
        """Upstream's ``size(mesh_dim)``; ``dim=`` is veScale legacy's keyword for it."""
        return super().size(mesh_dim if dim is None else dim)

    def get_rank(self) -> int:
        """This process's global rank (a meta mesh answers without a process group)."""
        return int(self._rank) if self.device_type == "meta" else super().get_rank()

    @staticmethod
    def from_group(*args: Any, **kwargs: Any) -> DeviceMesh:  # type: ignore[override]
        """As upstream ``DeviceMesh.from_group``, returning a ``vescale.DeviceMesh``."""
        return as_vescale_mesh(_UpstreamDeviceMesh.from_group(*args, **kwargs))

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        return as_vescale_mesh(super().__getitem__(mesh_dim_names))

    def _dims(self, dims: int | str | Sequence[int | str]) -> list[int]:
        items = [dims] if isinstance(dims, int | str) else list(dims)
        out = []
        for d in items:
            if isinstance(d, str):
                names = self.mesh_dim_names or ()
                if d not in names:
                    raise ValueError(f"DeviceMesh: no mesh dim named {d!r} in {self}")
                out.append(names.index(d))
            elif isinstance(d, int) and -self.ndim <= d < self.ndim:
                out.append(d % self.ndim)
            else:
                raise ValueError(f"DeviceMesh: mesh dim {d!r} out of range for {self}")
        if len(set(out)) != len(out):
            raise ValueError(f"DeviceMesh: repeated mesh dims {items} for {self}")
        return out

    def get_submesh(self, dims: int | str | Sequence[int | str]) -> DeviceMesh:
        """The sub-mesh over ``dims`` (names or indices, kept in mesh order) holding this rank."""
        idx = sorted(self._dims(dims))
        if self.mesh_dim_names is not None and self.device_type != "meta":
            names = tuple(self.mesh_dim_names[i] for i in idx)
            return self[names[0] if len(names) == 1 else names]
        coord = self.get_coordinate()
        if coord is None:
            raise ValueError(f"DeviceMesh.get_submesh: this rank is not in {self}")
        index = tuple(slice(None) if i in idx else coord[i] for i in range(self.ndim))
        return self._submesh(self.mesh[index], idx)

    def get_all_submesh(self, dim: int | str) -> list[DeviceMesh]:
        """All 1-D sub-meshes along ``dim``, in mesh order (this rank's one among them)."""
        (d,) = self._dims(dim)
        rows = self.mesh.movedim(d, -1).reshape(-1, self.mesh.size(d))
        return [self._submesh(row, [d]) for row in rows]

    def _submesh(self, sub: torch.Tensor, dims: list[int]) -> DeviceMesh:
        names = tuple(self.mesh_dim_names[i] for i in dims) if self.mesh_dim_names else None
        res = DeviceMesh(
            self.device_type, sub, mesh_dim_names=names, _init_backend=False, _rank=self.get_rank()
        )
        res._dim_group_names = []
        if self.device_type != "meta" and self.get_rank() in sub.flatten().tolist():
            groups = [self.get_group(i) for i in dims]
            res._dim_group_names = [g.group_name for g in groups]
            res._pg_registry.update({g.group_name: g for g in groups})
        return res


def check_device_type(device_type: str, what: str) -> None:
    """Raise a clear ``RuntimeError`` if ``device_type`` has a device module (``torch.cuda``,
    ``torch.xpu``, ...) that reports no device here; the ``fake`` backend (cross-compiling
    without devices) and ``cpu``/``meta`` are always accepted."""
    if device_type in ("cpu", "meta"):
        return
    if dist.is_initialized() and dist.get_backend() == "fake":
        return
    available = getattr(getattr(torch, device_type, None), "is_available", None)
    if callable(available) and not available():
        raise RuntimeError(
            f"{what}: device type {device_type!r} is not available on this machine "
            f"(torch.{device_type}.is_available() is False: no {device_type} device, or this "
            f"torch build lacks {device_type} support); use device_type='cpu' (gloo) here, or "
            f"run where {device_type} devices are present"
        )


def _check_ranks(device_type: str, mesh: Any) -> None:
    """Ranks in ``mesh`` are unique and (with a default group) fit the world size."""
    ranks = torch.as_tensor(mesh).flatten()
    if ranks.unique().numel() != ranks.numel():
        raise RuntimeError(f"DeviceMesh cannot have duplicate values, but found {ranks.tolist()}")
    if device_type != "meta" and dist.is_initialized() and ranks.numel() > dist.get_world_size():
        raise RuntimeError(
            f"DeviceMesh of {ranks.numel()} ranks {ranks.tolist()} is bigger than the world "
            f"size {dist.get_world_size()}"
        )


def as_vescale_mesh(mesh: _UpstreamDeviceMesh) -> DeviceMesh:
    """Return ``mesh`` typed as ``vescale.DeviceMesh`` (same object; no state is added)."""
    if not isinstance(mesh, DeviceMesh):
        mesh.__class__ = DeviceMesh
        register_mesh(mesh)
    return mesh  # type: ignore[return-value]


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
    timeout: datetime.timedelta | float | None = None,
    **kwargs: Any,
) -> DeviceMesh:
    """As upstream ``init_device_mesh``; ``device_type="meta"`` builds a meta mesh.

    ``timeout`` (a ``timedelta`` or seconds; default ``VESCALE_TIMEOUT_S``, 600 s) is the
    collective timeout of the groups this call creates: the mesh dim and flattened groups, and
    the default group when none exists yet (initialized here, as upstream does, with this
    timeout). A default group created before keeps its own timeout. The first
    mesh checks that ``VESCALE_DISABLE_REDISTRIBUTE`` agrees across ranks
    (:func:`~vescale.dtensor.explicit_env.agree_env_state`)."""
    check_device_type(device_type, "init_device_mesh")
    limit = _timeout(timeout)
    if device_type == "meta":
        ranks = torch.arange(int(torch.Size(mesh_shape).numel()), dtype=torch.int)
        return DeviceMesh("meta", ranks.reshape(mesh_shape), mesh_dim_names=mesh_dim_names)
    user_world = _world()
    if user_world is None:
        dist.init_process_group(timeout=limit)
    mesh = as_vescale_mesh(
        _upstream_init_device_mesh(device_type, mesh_shape, mesh_dim_names=mesh_dim_names, **kwargs)
    )
    flatten_mesh_dims(mesh)  # multi-dim reductions: one collective over the flattened group
    _set_timeouts(mesh, limit, user_world)
    agree_env_state()
    return mesh


def _timeout(value: datetime.timedelta | float | None) -> datetime.timedelta:
    """``init_device_mesh``'s ``timeout=`` as a positive ``timedelta``."""
    if value is None:
        return _watchdog.timeout()
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        value = datetime.timedelta(seconds=value)
    if not isinstance(value, datetime.timedelta) or not value.total_seconds() > 0:
        raise ValueError(
            f"init_device_mesh: timeout={value!r} is not a positive timedelta or number of seconds"
        )
    return value


def _set_timeouts(mesh: DeviceMesh, limit: datetime.timedelta, user_world: Any) -> None:
    """``limit`` on the groups of ``mesh`` and its flattened meshes, but ``user_world`` (the
    default group that existed before: the user's)."""
    if getattr(mesh, "_dim_group_names", None) is None or dist.get_backend() == "fake":
        return
    if mesh.get_coordinate() is None:  # a rank outside the mesh holds none of its groups
        return
    meshes = [mesh, *(m for m in flattened_meshes(mesh).values() if m is not None)]
    groups = {id(g): g for m in meshes for g in m.get_all_groups()}
    for group in groups.values():
        if group is not user_world:
            set_pg_timeout(limit, group)


def devices_per_host(device_type: str) -> int:
    """Upstream's cost model asks the device module how many devices a host has; the meta
    device has no module (``torch.meta``), so a meta mesh counts one (as ``cpu`` does).
    Installed over ``_mesh_resources.num_devices_per_host`` by ``vescale._patches``."""
    return 1 if device_type == "meta" else _upstream_devices_per_host(device_type)


_upstream_devices_per_host = _mesh_resources.num_devices_per_host
