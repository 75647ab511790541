"""Activation checkpointing of whole layers, applied before sharding and without renaming anything.

A checkpointed layer keeps only its inputs during forward and recomputes its activations in
backward. The layer's ``forward`` is replaced on the instance (no wrapper module), so parameter
names and ``state_dict`` keys stay exactly as they were, and FSDP2 units built on the same layers
afterwards still gather parameters around the recomputation (the torchtitan order: AC, then shard).
"""

import functools
from collections.abc import Callable, Collection
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


class _CheckpointedForward:
    """A forward that saves only its inputs and recomputes the rest in backward."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward
        functools.update_wrapper(self, forward, updated=())  # not __dict__: it would bring a wrapped wrapper's forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(
    model: nn.Module, layer_classes: Collection[type[nn.Module]], *, num_layers: int | None = None, interval: int = 1
) -> list[str]:
    """Checkpoint the activations of every module of ``layer_classes`` (or of the first ``num_layers``).

    Args:
        model: the model, before sharding.
        layer_classes: classes whose instances are checkpointed (the outermost match wins; a match
            nested inside another match is left alone, since its parent already recomputes it).
        num_layers: checkpoint only the first N matches, in module order; None checkpoints all.
        interval: selective checkpointing: only every ``interval``-th match (the 1st, the k+1-th, ...).

    Returns:
        The names of the checkpointed modules, in module order.

    Example:
        >>> apply_activation_checkpointing(model, {GPT2Block}, num_layers=6)
    """
    classes = tuple(layer_classes)
    matches = []
    for name, module in model.named_modules():
        if isinstance(module, classes) and not any(name.startswith(f"{outer}.") or not outer for outer, _ in matches):
            matches.append((name, module))
    names: list[str] = []
    for name, module in matches[::interval][:num_layers]:
        if not isinstance(module.forward, _CheckpointedForward):
            module.forward = _CheckpointedForward(module.forward)
        names.append(name)
    return names
