"""``torchacc.dist``: ranks, devices and collectives with TorchAcc's names, and the sharding mechanism.

Everything here works without torchrun as a world of one.
"""

from . import fsdp
from .collectives import all_reduce, barrier, broadcast, mark_step, reduce, rendezvous
from .env import (
    device,
    init_distributed,
    is_master_ordinal,
    local_rank,
    local_world_size,
    rank,
    teardown,
    world_size,
)

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
