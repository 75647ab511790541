"""Optimizer state out of GPU memory and back between phases: ``FSDP2Strategy.maybe_offload_optimizer`` and
``maybe_load_optimizer`` (for example around generation in RL training).

Under FSDP's ``CPUOffloadPolicy`` a parameter is a DTensor on a CUDA mesh whose local shard lives in CPU
memory, and so is its optimizer state: there the calls find the state in place and move nothing.
"""

import torch
from torch.distributed.tensor import DTensor

from ..distributed import env

__all__ = ["StrategyOffloadMixin", "move_optimizer_state"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | None) -> int:
    """Move the state tensors of ``optimizer`` to ``device`` (None: next to each one's parameter), in place.

    A DTensor is moved itself: ``DTensor.to`` moves its local shard and keeps its mesh and placements, with no
    communication. (``DTensor.from_local`` would put the shard back on the mesh's device type: a CUDA mesh under
    ``CPUOffloadPolicy`` holds shards in CPU memory.) State already in place is left as it is; scalars (Adam's
    ``step``) stay where the optimizer keeps them. After a move on a CUDA machine it synchronizes (copies to
    the host made with ``non_blocking`` are complete only then) and hands the freed blocks back to the driver.

    Returns:
        How many tensors moved.
    """
    moved = 0
    for param, state in optimizer.state.items():
        target = device if device is not None else _local(param).device
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or _local(value).device == target:
                continue
            state[key] = value.to(target, non_blocking=True)
            moved += 1
    if moved and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return moved


class StrategyOffloadMixin:
    """The optimizer-offload methods of ``FSDP2Strategy`` (see there for ``cpu_offload``)."""

    cpu_offload: bool

    def maybe_offload_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """With ``cpu_offload`` on a CUDA run, move optimizer state to CPU memory (e.g. during generation).

        Under FSDP ``cpu_offload`` keeps the parameters' shards, and so their optimizer state, in CPU memory
        already: nothing moves then. Without sharding (where ``cpu_offload`` cannot offload the parameters) the
        state leaves the GPU until ``maybe_load_optimizer``.
        """
        if self.cpu_offload and env.device().type == "cuda":
            move_optimizer_state(optimizer, torch.device("cpu"))

    def maybe_load_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring optimizer state moved by ``maybe_offload_optimizer`` back next to its parameters (the device of
        each parameter's local shard); state already there stays."""
        if self.cpu_offload and env.device().type == "cuda":
            move_optimizer_state(optimizer, None)
