"""What the engine did to a model: ``AcceleratedState``, kept beside the model (not on it) and looked up by it.

[Note: no state on the model] The engine records its work in registries keyed by the objects (held weakly),
not in attributes on the model or its parameters: later code asks ``accelerated_state(model)``, the name of a
sharded parameter (``parameter_name``, for optimizer-state errors) or the name of a parameter that sharding
replaced (``replaced_name``: an optimizer still holding one would train nothing). An object that is dropped
takes its entry with it, and the unsharded parameters are not kept alive while the model is sharded.
"""

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.weak import WeakIdKeyDictionary

from .layout import Layout

if TYPE_CHECKING:
    from .pipeline_step import PipelineRuntime

__all__ = [
    "AcceleratedState",
    "accelerated_state",
    "record_accelerated",
    "parameter_name",
    "record_parameter_names",
    "replaced_name",
    "record_replaced",
]

_STATES: "weakref.WeakKeyDictionary[nn.Module, AcceleratedState]" = weakref.WeakKeyDictionary()
_NAMES = WeakIdKeyDictionary()  # a parameter of an accelerated model -> its name in the model
_REPLACED = WeakIdKeyDictionary()  # a parameter that sharding or TP replaced -> the name it had


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
    pipeline: "PipelineRuntime | None" = None
    """This rank's stages and their schedule under pipeline parallelism (``dist.pp.size > 1``); None otherwise."""


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


def record_parameter_names(model: nn.Module) -> None:
    """Remember the name of each of ``model``'s (sharded) parameters."""
    for name, param in model.named_parameters():
        _NAMES[param] = name


def parameter_name(param: torch.Tensor, default: str = "?") -> str:
    """The name of a parameter of an accelerated model, or ``default``."""
    return _NAMES.get(param, default)


def record_replaced(originals: WeakIdKeyDictionary, model: nn.Module) -> None:
    """Remember the names of the parameters in ``originals`` (parameter -> name, taken before sharding, held
    weakly) that ``model`` no longer uses; the ones nobody holds any more are gone already."""
    current = dict(model.named_parameters())
    for param, name in list(originals.items()):
        if current.get(name) is not param:
            _REPLACED[param] = name


def replaced_name(param: torch.Tensor) -> str | None:
    """The name a parameter had before sharding or TP replaced it, or None for a parameter still in use."""
    return _REPLACED.get(param)
