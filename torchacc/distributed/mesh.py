"""The device mesh: FSDP, HSDP (replicate x shard), plain DP, and tensor, context and pipeline parallelism.

[Note: mesh layout] The mesh always has its axes in the order ``("dp", "fsdp")``, or
``("dp", "fsdp", "tp")`` with tensor parallelism, because ``fully_shard`` reads a 2-D mesh as
(replicate, shard) and TP takes the innermost axis. ``topology`` only decides which ranks land where:
with the default ``("dp", "fsdp", "tp")`` the ranks of one TP group are contiguous (``0,1 | 2,3``,
one node), then the ranks that shard one model copy; ``("fsdp", "dp")`` strides the shards.

With pipeline parallelism (``pp_size > 1``) the pipeline is the outermost axis, whatever the topology: the
mesh is ``("pp", "dp", "fsdp")`` or ``("pp", "dp", "fsdp", "tp")``, and the ranks of stage ``s`` are
``s * n .. (s + 1) * n - 1`` (``n`` ranks per stage, laid out inside as without a pipeline): the traffic between
stages, activations at the stage boundaries, is the least of all axes and may cross nodes.

[Note: context-parallel mesh] With context parallelism the axes are ``("pp", "dp", "fsdp", "cp", "tp")``,
outermost first, each present only when its size is above 1, except ``fsdp`` (always) and ``dp`` (always
with TP or a pipeline, as above). The ranks of one CP group sit just outside ``tp`` in the rank layout, whatever
the ``topology``. They hold the same parameters, so ``fully_shard`` shards over ``fsdp x cp`` flattened into one
``"fsdp_cp"`` axis (TorchTitan's ``dp_shard_cp``), and HSDP replicates that over ``dp``.
"""

import weakref
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "build_mesh",
    "context_parallel_rank",
    "cp_submesh",
    "data_parallel_rank",
    "fsdp_submesh",
    "pp_submesh",
    "shard_of_rank",
    "tp_submesh",
]

AXES = ("dp", "fsdp")
TP_AXES = ("dp", "fsdp", "tp")
ALL_AXES = ("pp", "dp", "fsdp", "cp", "tp")
# by identity: meshes of one shape compare equal whatever their groups, and one from a fake world (the planner's)
# must not hand its groups to a real mesh, nor the other way round
_SHARD_MESHES: dict[int, tuple["weakref.ref[DeviceMesh]", DeviceMesh]] = {}


def _grid(sizes: dict[str, int], topology: Sequence[str]) -> torch.Tensor:
    """Every rank, laid out in ``topology`` order ("tp" innermost when absent, "cp" just outside "tp", "pp"
    outermost), viewed as a ``(pp, dp, fsdp, cp, tp)`` grid."""
    axes = list(topology) if "tp" in topology else [*topology, "tp"]
    if sorted(axes) != sorted(TP_AXES):
        raise ValueError(f"topology={list(topology)} must be a permutation of {list(AXES)} or {list(TP_AXES)}")
    axes.insert(axes.index("tp"), "cp")
    axes.insert(0, "pp")
    sizes = {"pp": 1, "cp": 1, **sizes}
    grid = torch.arange(torch.Size([sizes[a] for a in axes]).numel()).reshape([sizes[a] for a in axes])
    return grid.permute([axes.index(name) for name in ALL_AXES]).contiguous()


def build_mesh(
    *,
    device_type: str,
    dp_size: int,
    fsdp_size: int,
    tp_size: int = 1,
    topology: Sequence[str] = AXES,
    pp_size: int = 1,
    cp_size: int = 1,
) -> DeviceMesh:
    """Build the mesh that ``wrap_fsdp`` (and, with ``tp_size > 1``, ``apply_tp``) works on.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        dp_size: number of model replicas.
        fsdp_size: number of ranks that shard one replica.
        tp_size: number of ranks that split each tensor-parallel layer.
        topology: the axes outermost first: a permutation of ``("dp", "fsdp")`` ("tp" innermost) or of
            ``("dp", "fsdp", "tp")``.
        pp_size: number of pipeline stages (ranks holding different parts of the model), outside everything else.
        cp_size: number of ranks that split each sequence (context parallelism).

    Returns:
        Without TP: a 1-D mesh named ``("fsdp",)`` when ``dp_size == 1``, otherwise a 2-D mesh named
        ``("dp", "fsdp")`` (HSDP). With TP: a 3-D mesh named ``("dp", "fsdp", "tp")``; take its parts with
        ``fsdp_submesh`` and ``tp_submesh``. With ``pp_size > 1``: ``("pp", "dp", "fsdp")`` or ``("pp", "dp",
        "fsdp", "tp")`` (take the pipeline axis with ``pp_submesh``). With ``cp_size > 1`` a ``"cp"`` axis stands
        before ``"tp"`` (see [Note: context-parallel mesh]), e.g. ``("fsdp", "cp")``; take it with ``cp_submesh``.
        Plain DP without TP needs no mesh (DDP uses the default group).

    Raises:
        ValueError: ``topology`` is not a permutation of the axes.

    Example:
        >>> mesh = build_mesh(device_type="cpu", dp_size=1, fsdp_size=2, tp_size=2)  # under torchrun, 4 ranks
    """
    sizes = {"pp": pp_size, "dp": dp_size, "fsdp": fsdp_size, "cp": cp_size, "tp": tp_size}
    grid = _grid(sizes, topology)
    if dp_size == 1 and pp_size == tp_size == cp_size == 1:
        return init_device_mesh(device_type, (fsdp_size,), mesh_dim_names=("fsdp",))
    names = [
        name
        for name in ALL_AXES
        if sizes[name] > 1 or name == "fsdp" or (name == "dp" and (tp_size > 1 or pp_size > 1))
    ]
    return DeviceMesh(device_type, grid.reshape([sizes[name] for name in names]), mesh_dim_names=tuple(names))


def shard_of_rank(mesh: DeviceMesh) -> list[int]:
    """Each global rank's shard index on a plain FSDP or HSDP ``mesh`` (``("fsdp",)`` or ``("dp", "fsdp")``, over
    every rank): its coordinate on the ``"fsdp"`` axis, which is the chunk of each parameter FSDP2 leaves it."""
    grid = mesh.mesh
    coordinate = torch.arange(grid.shape[-1]).expand_as(grid)
    index = [0] * grid.numel()
    for rank, shard in zip(grid.flatten().tolist(), coordinate.flatten().tolist(), strict=True):
        index[rank] = shard
    return index


def fsdp_submesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The part of ``mesh`` that ``fully_shard`` uses: ``("fsdp",)`` or ``("dp", "fsdp")``; None when nothing
    is sharded (a TP-only or pipeline-only mesh). With a "cp" axis: ``("fsdp_cp",)`` or ``("dp", "fsdp_cp")``, the
    same object on every call."""
    if mesh is not None and "cp" in (mesh.mesh_dim_names or ()):
        return _cp_shard_mesh(mesh)
    if mesh is None or not {"tp", "pp"} & set(mesh.mesh_dim_names or ()):
        return mesh
    dp, fsdp = mesh["dp"].size(), mesh["fsdp"].size()
    if dp * fsdp == 1:
        return None
    return mesh["fsdp"] if dp == 1 else mesh["dp", "fsdp"]


def _cp_shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    # See [Note: context-parallel mesh]. Cached: _unflatten builds new process groups at every call.
    ref, shard = _SHARD_MESHES.get(id(mesh), (None, None))
    if ref is None or ref() is not mesh or shard is None:
        names = mesh.mesh_dim_names or ()
        if "dp" in names and mesh["dp"].size() > 1:
            dp, fsdp_cp = mesh["dp"].size(), mesh["fsdp"].size() * mesh["cp"].size()
            flat = mesh["dp", "fsdp", "cp"]._flatten("dp_fsdp_cp")
            shard = flat._unflatten(0, (dp, fsdp_cp), ("dp", "fsdp_cp"))
        else:
            shard = mesh["fsdp", "cp"]._flatten("fsdp_cp")
        key = id(mesh)
        _SHARD_MESHES[key] = (weakref.ref(mesh, lambda _: _SHARD_MESHES.pop(key, None)), shard)
    return shard


def _axis(mesh: DeviceMesh | None, name: str) -> DeviceMesh | None:
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return None
    return mesh[name]


def cp_submesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The ``("cp",)`` part of ``mesh``, or None without context parallelism."""
    return _axis(mesh, "cp")


def tp_submesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The ``("tp",)`` part of ``mesh``, or None without tensor parallelism."""
    return _axis(mesh, "tp")


def pp_submesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The ``("pp",)`` part of ``mesh``, or None without pipeline parallelism."""
    return _axis(mesh, "pp")


def _coordinate(rank: int, sizes: dict[str, int], topology: Sequence[str]) -> dict[str, int]:
    grid = _grid(sizes, topology)
    return dict(zip(ALL_AXES, (int(i) for i in (grid == rank).nonzero()[0]), strict=True))


def data_parallel_rank(
    rank: int,
    *,
    dp_size: int,
    fsdp_size: int,
    tp_size: int = 1,
    topology: Sequence[str] = AXES,
    pp_size: int = 1,
    cp_size: int = 1,
) -> int:
    """This rank's index among the ``dp_size * fsdp_size`` data-parallel ranks: the ranks of one TP group share it
    (they must see the same batches), and so do the stages of one pipeline and the ranks of one CP group. Pure
    arithmetic, no communication.

    Example:
        >>> data_parallel_rank(3, dp_size=1, fsdp_size=2, tp_size=2)  # ranks 0,1 | 2,3 are the TP groups
        1
    """
    sizes = {"pp": pp_size, "dp": dp_size, "fsdp": fsdp_size, "cp": cp_size, "tp": tp_size}
    where = _coordinate(rank, sizes, topology)
    return where["dp"] * fsdp_size + where["fsdp"]


def context_parallel_rank(
    rank: int,
    *,
    dp_size: int,
    fsdp_size: int,
    cp_size: int,
    tp_size: int = 1,
    topology: Sequence[str] = AXES,
    pp_size: int = 1,
) -> int:
    """This rank's index in its CP group: which chunk of every sequence it takes. Pure arithmetic.

    Example:
        >>> context_parallel_rank(3, dp_size=1, fsdp_size=2, cp_size=2)  # ranks 0,1 | 2,3 are the CP groups
        1
    """
    sizes = {"pp": pp_size, "dp": dp_size, "fsdp": fsdp_size, "cp": cp_size, "tp": tp_size}
    return _coordinate(rank, sizes, topology)["cp"]
