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
put back as it was. DTensor caches its sharding decisions by mesh, and two meshes of the same shape compare
equal whatever their groups: a decision cached in the fake world would send the caller's DTensors to groups
that no longer exist, and one cached before it would send fake work to real groups. Those caches are emptied on
the way in and on the way out (they refill on the next operations).
"""

import contextlib
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

    _clear_dtensor_caches()
    c10d._world = world
    c10d._process_group_name = process_group_name
    try:
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
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """Forget DTensor's sharding decisions and redistribution plans, which hold meshes (see [Note: fake world])."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    clear_redistribute_planner_cache()
