"""Tied tensors: one tensor reachable under several names (GPT-2's ``wte.weight`` and ``lm_head.weight``).

The one detector of ties, for a model's parameters and for a state dict loaded from a file alike.
"""

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["tied_names", "retie"]


def _identity(tensor: torch.Tensor) -> tuple:
    if tensor.is_meta or is_traceable_wrapper_subclass(tensor):
        # no storage of their own to compare (meta tensors, DTensors): only the same object is the same tensor
        return ("object", id(tensor))
    storage = tensor.untyped_storage()
    return (storage.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())


def tied_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Every alias name of a tied tensor -> the first name it came under.

    Tensors are tied when they are one object, or (as ``torch.load`` returns them) views of one storage
    with the same offset, shape and stride. Empty tensors are never tied.

    Args:
        named_tensors: ``(name, tensor)`` pairs, e.g. ``model.named_parameters(remove_duplicate=False)`` or
            ``state_dict.items()``.

    Example:
        >>> tied_names(gpt2.named_parameters(remove_duplicate=False))
        {'lm_head.weight': 'transformer.wte.weight'}
    """
    first: dict[tuple, str] = {}
    aliases = {}
    for name, tensor in named_tensors:
        if tensor.numel() == 0:
            continue
        owner = first.setdefault(_identity(tensor), name)
        if owner != name:
            aliases[name] = owner
    return aliases


def retie(model: nn.Module, aliases: dict[str, str]) -> None:
    """Make every alias name of ``aliases`` (from :func:`tied_names`) the same parameter as its first name again."""
    for alias, owner in aliases.items():
        module_name, _, attr = alias.rpartition(".")
        module = model.get_submodule(module_name)
        param = model.get_parameter(owner)
        if module._parameters.get(attr) is not param:
            module._parameters[attr] = param
