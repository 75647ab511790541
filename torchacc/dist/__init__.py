"""``torchacc.dist``: ranks, devices and collectives with TorchAcc's names, and the sharding mechanism.

The public face of ``torchacc.distributed`` (the low layer: ``env``, ``collectives``, ``mesh``) plus
``torchacc.dist.fsdp`` (wrapping by class name, and TorchAcc's consolidation helpers under their original
home). Everything here works without torchrun as a world of one.
"""

from ..distributed import collectives, env, mesh
from ..distributed.collectives import all_reduce, barrier, broadcast, mark_step, reduce, rendezvous
from ..distributed.env import (
    device,
    init_distributed,
    is_master_ordinal,
    local_rank,
    local_world_size,
    rank,
    teardown,
    world_size,
)
from . import fsdp

__all__ = [
    "init_distributed",
    "rank",
    "world_size",
    "local_rank",
    "local_world_size",
    "is_master_ordinal",
    "device",
    "rendezvous",
    "mark_step",
    "barrier",
    "broadcast",
    "all_reduce",
    "reduce",
    "teardown",
    "fsdp",
]
__all__ += ["collectives", "env", "mesh"]  # the modules, as before the package layout
