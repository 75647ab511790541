"""The device mesh for data parallelism: FSDP, HSDP (replicate x shard) or plain DP.

[Note: mesh layout] The mesh always has its axes in the order ``("dp", "fsdp")`` because
``fully_shard`` reads a 2-D mesh as (replicate, shard). ``topology`` only decides which ranks land
where: with the default ``("dp", "fsdp")`` the ranks that shard one model copy are contiguous
(``0,1 | 2,3``), which keeps the all-gathers inside a node; ``("fsdp", "dp")`` strides them.
"""

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["build_mesh"]

AXES = ("dp", "fsdp")


def build_mesh(*, device_type: str, dp_size: int, fsdp_size: int, topology: Sequence[str] = AXES) -> DeviceMesh:
    """Build the mesh that ``wrap_fsdp`` shards over.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        dp_size: number of model replicas.
        fsdp_size: number of ranks that shard one replica.
        topology: the axes outermost first, a permutation of ``("dp", "fsdp")``.

    Returns:
        A 1-D mesh named ``("fsdp",)`` when ``dp_size == 1``, otherwise a 2-D mesh named ``("dp", "fsdp")``
        (HSDP). Plain DP (``fsdp_size == 1``) needs no mesh: DDP replicates over the default group.

    Raises:
        ValueError: ``topology`` is not a permutation of the two axes.

    Example:
        >>> mesh = build_mesh(device_type="cpu", dp_size=2, fsdp_size=2)  # under torchrun, 4 ranks
    """
    if sorted(topology) != sorted(AXES):
        raise ValueError(f"topology={list(topology)} must be a permutation of {list(AXES)}")
    if dp_size == 1:
        return init_device_mesh(device_type, (fsdp_size,), mesh_dim_names=("fsdp",))
    sizes = {"dp": dp_size, "fsdp": fsdp_size}
    ranks = torch.arange(dp_size * fsdp_size).reshape([sizes[axis] for axis in topology])
    if list(topology) != list(AXES):
        ranks = ranks.transpose(0, 1)
    return DeviceMesh(device_type, ranks.contiguous(), mesh_dim_names=AXES)
