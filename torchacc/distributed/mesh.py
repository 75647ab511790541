"""The device mesh: FSDP, HSDP (replicate x shard), plain DP, and tensor parallelism inside them.

[Note: mesh layout] The mesh always has its axes in the order ``("dp", "fsdp")``, or
``("dp", "fsdp", "tp")`` with tensor parallelism, because ``fully_shard`` reads a 2-D mesh as
(replicate, shard) and TP takes the innermost axis. ``topology`` only decides which ranks land where:
with the default ``("dp", "fsdp", "tp")`` the ranks of one TP group are contiguous (``0,1 | 2,3``,
one node), then the ranks that shard one model copy; ``("fsdp", "dp")`` strides the shards.

With pipeline parallelism (``pp_size > 1``) the pipeline is the outermost axis, whatever the topology: the
mesh is ``("pp", "dp", "fsdp")`` or ``("pp", "dp", "fsdp", "tp")``, and the ranks of stage ``s`` are
``s * n .. (s + 1) * n - 1`` (``n`` ranks per stage, laid out inside as without a pipeline): the traffic between
stages, activations at the stage boundaries, is the least of all axes and may cross nodes.
"""

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["build_mesh", "data_parallel_rank", "fsdp_submesh", "pp_submesh", "tp_submesh"]

AXES = ("dp", "fsdp")
TP_AXES = ("dp", "fsdp", "tp")


def _rank_grid(sizes: dict[str, int], topology: Sequence[str]) -> torch.Tensor:
    """Ranks laid out in ``topology`` order (outermost first; "tp" innermost when absent), viewed as a
    ``(dp, fsdp, tp)`` grid."""
    axes = list(topology) if "tp" in topology else [*topology, "tp"]
    if sorted(axes) != sorted(TP_AXES):
        raise ValueError(f"topology={list(topology)} must be a permutation of {list(AXES)} or {list(TP_AXES)}")
    grid = torch.arange(sizes["dp"] * sizes["fsdp"] * sizes["tp"]).reshape([sizes[axis] for axis in axes])
    return grid.permute([axes.index(name) for name in TP_AXES]).contiguous()


def build_mesh(
    *,
    device_type: str,
    dp_size: int,
    fsdp_size: int,
    tp_size: int = 1,
    topology: Sequence[str] = AXES,
    pp_size: int = 1,
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

    Returns:
        Without TP: a 1-D mesh named ``("fsdp",)`` when ``dp_size == 1``, otherwise a 2-D mesh named
        ``("dp", "fsdp")`` (HSDP). With TP: a 3-D mesh named ``("dp", "fsdp", "tp")``; take its parts with
        ``fsdp_submesh`` and ``tp_submesh``. With ``pp_size > 1``: ``("pp", "dp", "fsdp")`` or ``("pp", "dp",
        "fsdp", "tp")`` (take the pipeline axis with ``pp_submesh``). Plain DP without TP needs no mesh (DDP uses
        the default group).

    Raises:
        ValueError: ``topology`` is not a permutation of the axes.

    Example:
        >>> mesh = build_mesh(device_type="cpu", dp_size=1, fsdp_size=2, tp_size=2)  # under torchrun, 4 ranks
    """
    grid = _rank_grid({"dp": dp_size, "fsdp": fsdp_size, "tp": tp_size}, topology)
    if pp_size > 1:
        stages = torch.stack([grid + stage * grid.numel() for stage in range(pp_size)])
        if tp_size > 1:
            return DeviceMesh(device_type, stages, mesh_dim_names=("pp", *TP_AXES))
        return DeviceMesh(device_type, stages[..., 0].contiguous(), mesh_dim_names=("pp", *AXES))
    if tp_size > 1:
        return DeviceMesh(device_type, grid, mesh_dim_names=TP_AXES)
    if dp_size == 1:
        return init_device_mesh(device_type, (fsdp_size,), mesh_dim_names=("fsdp",))
    return DeviceMesh(device_type, grid[:, :, 0].contiguous(), mesh_dim_names=AXES)


def fsdp_submesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The part of ``mesh`` that ``fully_shard`` uses: ``("fsdp",)`` or ``("dp", "fsdp")``; None when nothing
    is sharded (a TP-only or pipeline-only mesh)."""
    if mesh is None or not {"tp", "pp"} & set(mesh.mesh_dim_names or ()):
        return mesh
    dp, fsdp = mesh["dp"].size(), mesh["fsdp"].size()
    if dp * fsdp == 1:
        return None
    return mesh["fsdp"] if dp == 1 else mesh["dp", "fsdp"]


def tp_submesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The ``("tp",)`` part of ``mesh``, or None without tensor parallelism."""
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["tp"]


def pp_submesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The ``("pp",)`` part of ``mesh``, or None without pipeline parallelism."""
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["pp"]


def data_parallel_rank(
    rank: int, *, dp_size: int, fsdp_size: int, tp_size: int = 1, topology: Sequence[str] = AXES, pp_size: int = 1
) -> int:
    """This rank's index among the ``dp_size * fsdp_size`` data-parallel ranks: the ranks of one TP group share it,
    and so do the stages of one pipeline (they must see the same batches). Pure arithmetic, no communication.

    Example:
        >>> data_parallel_rank(3, dp_size=1, fsdp_size=2, tp_size=2)  # ranks 0,1 | 2,3 are the TP groups
        1
    """
    grid = _rank_grid({"dp": dp_size, "fsdp": fsdp_size, "tp": tp_size}, topology)
    if pp_size > 1:
        rank %= grid.numel()  # the same place in every stage: see [Note: mesh layout]
    dp, fsdp, _ = (int(i) for i in (grid == rank).nonzero()[0])
    return dp * fsdp_size + fsdp
