"""A process group of any size inside this one process, that communicates nothing: ``fake_process_group``.

[Note: fake world] The planner lays a model out for 512 ranks on a laptop: ``init_device_mesh``, ``fully_shard``
and ``parallelize_module`` only need a default process group of the right size and rank, and torch's "fake"
backend (``torch.testing._internal.distributed.fake_pg``) provides one whose collectives return at once. It
must not disturb the caller, who may be inside a real job: c10d keeps its groups in module state (``_world``,
whose maps are module globals, plus the backend name, the init method and ``sys.excepthook``, which
``init_process_group`` replaces) and registers every group by name in a C++ registry that refuses a name
twice. So, for the duration of the block, ``_world`` is swapped for a private one with maps of its own (as
torch's threaded test groups do), every group name gets a prefix of its own (no clash with the caller's
groups in the registry), and on exit the fake groups are shut down and unregistered one by one (never
``destroy_process_group()`` on the world, which would unregister the caller's groups too) and everything is
put back as it was.

[Note: fake meshes and DTensor's caches] DTensor caches its decisions (sharding propagation, redistribution
plans, mesh topology) by mesh, and two meshes of the same shape compare equal whatever their groups; a cached
decision holds the mesh it was first made on, which the DTensors that op makes later take as theirs, groups
included. A decision cached in the fake world would so send the caller's DTensors to fake groups, and one
cached before it fake work to real groups. Emptying the caches is no cure: an estimate runs on one rank or some
(a script printing its plan on rank 0), and a rank with emptied caches then sends a new model's DTensors to its
new groups while the others still send theirs to an equal earlier model's groups, and the job hangs in the next
collective. So the caches are left alone: every mesh made in the block carries a mark of its world, so that it
equals no mesh outside (the way torch marks the meshes of its threaded test groups), and DTensor's Python
caches are swapped for empty ones for the block, the caller's put back after it. The C++ fast path's cache (one
per thread) can be neither swapped nor emptied (it alone holds most of the caller's decisions, and emptying it
on some ranks hangs the job as above): it keeps the fake world's decisions, which no later mesh can match, as do
the caches of another thread that a fake step's backward runs on (a CUDA device's autograd thread).
"""

import contextlib
import functools
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["fake_process_group"]


class _PrivateWorld(c10d._World):
    """A ``_World`` whose maps are its own (the base class's properties return module globals)."""

    def __init__(self) -> None:
        super().__init__()
        self._maps: dict[str, dict] = {
            name: {}
            for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "tags_to_pg", "pg_to_tag")
        }
        self._count = 0

    pg_map = property(lambda self: self._maps["pg_map"])
    pg_names = property(lambda self: self._maps["pg_names"])
    pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._maps["pg_backend_config"])
    tags_to_pg = property(lambda self: self._maps["tags_to_pg"])
    pg_to_tag = property(lambda self: self._maps["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._count = value


@contextlib.contextmanager
def fake_process_group(*, world_size: int, rank: int = 0) -> Iterator[None]:
    """Run the block as rank ``rank`` of a fake default process group of ``world_size`` ranks.

    Meshes, ``fully_shard`` and ``parallelize_module`` work as in a real job (on meta or fake tensors); no
    collective moves data. The caller's process group, if any, is hidden inside the block and back after it,
    untouched, as are ``sys.excepthook`` and the rest of c10d's state (see [Note: fake world]).

    Args:
        world_size: the number of ranks to pretend.
        rank: the rank this process plays.

    Example:
        >>> with fake_process_group(world_size=512):
        ...     mesh = init_device_mesh("cpu", (64, 8), mesh_dim_names=("fsdp", "tp"))
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    saved: dict[str, Any] = {
        name: getattr(c10d, name) for name in ("_world", "_backend", "_default_pg_init_method", "_process_group_name")
    }
    hook = sys.excepthook
    world = _PrivateWorld()
    prefix = f"torchacc-fake-{uuid.uuid4().hex[:12]}-"
    name_group = saved["_process_group_name"]

    def process_group_name(ranks: Any, use_hashed_name: bool) -> Any:
        return type(name := name_group(ranks, use_hashed_name))(prefix + name)

    c10d._world = world
    c10d._process_group_name = process_group_name
    try:
        with _marked_meshes(prefix), _own_dtensor_caches():
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            yield
    finally:
        for group, name in list(world.pg_names.items()):
            with contextlib.suppress(Exception):  # one group that will not shut down must not keep the others
                group.shutdown()
            with contextlib.suppress(Exception):
                torch._C._distributed_c10d._unregister_process_group(name)
        world.default_pg = None
        for name, value in saved.items():
            setattr(c10d, name, value)
        sys.excepthook = hook


@contextlib.contextmanager
def _marked_meshes(mark: str) -> Iterator[None]:
    """Every ``DeviceMesh`` made in the block equals no mesh made outside it (see [Note: fake meshes and DTensor's
    caches]): ``_thread_id``, which ``__eq__`` and ``__hash__`` compare, is the world's mark instead of None."""
    from torch.distributed.device_mesh import DeviceMesh

    init = DeviceMesh.__dict__["__init__"]

    @functools.wraps(init)
    def marked_init(mesh: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        init(mesh, *args, **kwargs)
        mesh._thread_id = mark  # type: ignore[assignment]
        mesh._hash = None

    DeviceMesh.__init__ = marked_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = init  # type: ignore[method-assign]


def _dtensor_caches() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, an empty one)`` for each of DTensor's Python caches keyed by meshes."""
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    def empty(cached: Any) -> Any:
        return functools.lru_cache(cached.cache_parameters()["maxsize"])(cached.__wrapped__)

    sharding = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding  # this thread's holder of a cache
    return [
        (sharding, "cache", empty(sharding.cache)),
        (ShardingPropagator, "_propagate_tensor_meta_cached", empty(ShardingPropagator._propagate_tensor_meta_cached)),
        (MeshTopoInfo, "build_from_mesh", staticmethod(empty(MeshTopoInfo.build_from_mesh))),
        (_redistribute, "_gen_transform_infos", empty(_redistribute._gen_transform_infos)),
        (_redistribute, "_planner_cache", {}),
    ]


@contextlib.contextmanager
def _own_dtensor_caches() -> Iterator[None]:
    """DTensor's Python caches empty in the block, the caller's back after it, untouched (see [Note: fake meshes
    and DTensor's caches])."""
    swaps = _dtensor_caches()
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in swaps]
    for owner, name, fresh in swaps:
        setattr(owner, name, fresh)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
