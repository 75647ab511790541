"""Tied parameters: one parameter reachable under several names (GPT-2's ``wte.weight`` and ``lm_head.weight``)."""

import torch.nn as nn

__all__ = ["tied_names", "retie"]


def tied_names(model: nn.Module) -> dict[str, str]:
    """Every alias name of a shared parameter -> the first name it has (in ``named_parameters`` order).

    Example:
        >>> tied_names(gpt2)
        {'lm_head.weight': 'transformer.wte.weight'}
    """
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
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
