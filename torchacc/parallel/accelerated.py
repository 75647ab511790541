"""What the engine did to a model: ``AcceleratedState``, kept beside the model (not on it) and looked up by it.

[Note: no state on the model] The engine records its work in a registry keyed by the model object (held
weakly), not in attributes on the model or its parameters: checkpoint and metrics code asks
``accelerated_state(model)``, and a model that is dropped takes its entry with it.
"""

import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .layout import Layout

__all__ = ["AcceleratedState", "accelerated_state", "record_accelerated"]

_STATES: "weakref.WeakKeyDictionary[nn.Module, AcceleratedState]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class AcceleratedState:
    """What ``accelerate()`` (or ``FSDP2Strategy.parallelize``) did to one model."""

    layout: Layout
    """The resolved layout the model was built with."""
    device: torch.device
    mesh: DeviceMesh | None
    """The whole mesh; None for plain data parallelism and one process."""
    compute_dtype: torch.dtype | None
    """The low compute dtype (bf16/fp16) or None for float32."""
    run_id: str
    """New for each accelerated model, the same on all its ranks; recorded in its shard metadata."""


def record_accelerated(model: nn.Module, state: AcceleratedState) -> None:
    """Remember ``state`` for ``model`` (the engine calls it once, at the end of ``shard_model``)."""
    _STATES[model] = state


def accelerated_state(model: nn.Module) -> AcceleratedState | None:
    """What the engine did to ``model``, or None for a model that ``accelerate()`` never saw.

    Example:
        >>> torchacc.parallel.accelerated.accelerated_state(model).layout.dims.describe()
        'fsdp=2'
    """
    return _STATES.get(model)
