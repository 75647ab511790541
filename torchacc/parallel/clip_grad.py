"""Gradient clipping that sees the whole gradient, however it is sharded.

Under FSDP each rank holds a shard of every gradient, under HSDP the shards are replicated
across the ``dp`` axis, and under TP the split layers' gradients are sharded over ``tp`` too. The
norm of the full gradient sums the squared shards over the shard axes only (summing over replicas
too would count every element several times), and is the same on every rank. Logging a per-rank
norm instead under-reports it by about sqrt(number of shards). Under pipeline parallelism each stage holds
other parameters: the stages' sums of squares add up over the pipeline group.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from .pipeline_step import pipeline_group

__all__ = ["clip_grad_norm_", "grad_norm"]


def grad_norm(parameters: Iterable[torch.Tensor]) -> float:
    """The 2-norm of all gradients of ``parameters`` taken together, as if nothing were sharded.

    Every rank must call it with its own (matching) parameters; it communicates once per mesh (and once over the
    pipeline when the parameters are a pipeline stage's).
    """
    parameters = list(parameters)
    plain = torch.zeros((), dtype=torch.float64)
    per_mesh: dict[tuple, torch.Tensor] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                # a norm weight under sequence parallelism: each TP rank holds the sum over its own tokens
                grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
            # not is_shard(): FSDP over a TP split of dim 0 is a _StridedShard, whose is_shard() is False
            shard_dims = tuple(i for i, p in enumerate(grad.placements) if getattr(p, "dim", None) is not None)
            key = (grad.device_mesh, shard_dims)
            squares = grad.to_local().double().square().sum()
            per_mesh[key] = per_mesh[key] + squares if key in per_mesh else squares
        else:
            plain += grad.detach().double().square().sum().cpu()
    total = plain
    for (mesh, shard_dims), squares in per_mesh.items():
        for dim in shard_dims:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        total = total + squares.cpu()
    group = pipeline_group(parameters)
    if group is not None:
        dist.all_reduce(total, group=group)  # a CPU tensor: gloo, also in a CUDA job
    return float(total.sqrt())


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, *, eps: float = 1e-6) -> float:
    """Scale all gradients so that their global 2-norm is at most ``max_norm``; return the norm before clipping.

    Equivalent to ``torch.nn.utils.clip_grad_norm_`` on the unsharded model, for FSDP, HSDP, DDP
    and single-process models alike.

    Args:
        parameters: the model's parameters (DTensor or plain).
        max_norm: the largest allowed global norm.
        eps: added to the norm before dividing, as torch does.

    Returns:
        The global norm before clipping, as a float (the same on every rank).

    Example:
        >>> norm = torchacc.clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    from ..metrics.install import note_grad_norm  # here: torchacc.metrics imports this module

    parameters = list(parameters)
    params = [p for p in parameters if p.grad is not None]
    norm = grad_norm(parameters)
    note_grad_norm(norm, params)  # a metrics record of this step reuses it instead of computing it again
    coef = max_norm / (norm + eps)
    if coef < 1.0:
        for param in params:
            param.grad.mul_(coef)
    return norm
