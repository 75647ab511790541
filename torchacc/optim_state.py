"""Optimizer state keyed by parameter names, so it survives a change of world size or layout.

``optimizer.state_dict()`` keys state by position (0, 1, ...), which only means something next to
the exact optimizer that wrote it, and under FSDP holds this rank's shards. These helpers key by
the model's parameter names and convert between full tensors, DTensors and local shards.
"""

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .sharded_state import check_shard_metadata

__all__ = ["optim_state_dict", "load_optim_state_dict"]


def _names_by_index(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter name of each optimizer index, in ``optimizer.state_dict()`` order."""
    names = {param: name for name, param in model.named_parameters()}
    ordered = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not in "
                    f"{type(model).__name__}; build it from the accelerated model's parameters"
                )
            ordered.append(names[param])
    return ordered


def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool = False) -> dict[str, Any]:
    """The optimizer's state keyed by parameter names.

    Args:
        model: the (accelerated) model the optimizer trains.
        optimizer: the optimizer.
        full: gather sharded state into full CPU tensors (a collective: every rank must call it);
            False keeps DTensors, which ``torchacc.save(..., master_only=False)`` stores as local shards.

    Returns:
        ``{"state": {param name: {key: value}}, "param_groups": [{..., "params": [param names]}]}``.

    Example:
        >>> shard = {"optimizer": torchacc.optim_state_dict(model, opt), "shard_metadata": model.get_shard_metadata()}
        >>> torchacc.save(shard, f"ckpt/rank-{rank}-of-{world}-optim.pth", master_only=False)
    """
    names = _names_by_index(model, optimizer)
    raw = optimizer.state_dict()
    state = {}
    for index, values in raw["state"].items():
        state[names[index]] = {
            key: (value.full_tensor().cpu() if full and isinstance(value, DTensor) else value)
            for key, value in values.items()
        }
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in raw["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_optim_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    *,
    shard_metadata: dict[str, Any] | None = None,
) -> None:
    """Load optimizer state saved by ``optim_state_dict`` (full or sharded), or ``optimizer.state_dict()``.

    Full tensors are cut to this rank's shard without communication, so a consolidated optimizer
    state loads at any world size. Local shards need the ``shard_metadata`` saved with them.

    Args:
        model: the accelerated model the optimizer trains.
        optimizer: the optimizer built on it.
        state_dict: name-keyed (``optim_state_dict``, a consolidated file's ``["optimizer"]``) or index-keyed
            (``optimizer.state_dict()`` of the same optimizer layout).
        shard_metadata: ``model.get_shard_metadata()`` of the run that saved local shards.

    Raises:
        ValueError: param groups that do not match this optimizer's, state for an unknown parameter, or a
            tensor that is neither full-shaped nor a matching local shard.
    """
    if shard_metadata is not None:
        check_shard_metadata(shard_metadata)
    names = _names_by_index(model, optimizer)
    index_of = {name: i for i, name in enumerate(names)}
    groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    live_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != live_sizes:
        raise ValueError(
            f"the saved optimizer has param groups of sizes {sizes} but this one has {live_sizes}; build the "
            "optimizer with the same parameter groups as the run that saved it"
        )
    params = dict(model.named_parameters())
    state = {}
    for key, values in state_dict["state"].items():
        name = names[key] if isinstance(key, int) else key
        if name not in index_of:
            raise ValueError(f"saved optimizer state for {name!r}, which is not a parameter of {type(model).__name__}")
        state[index_of[name]] = {k: _like(params[name], name, k, v, shard_metadata) for k, v in values.items()}
    live_groups = [
        {**saved, "params": [index_of[n] if isinstance(n, str) else n for n in saved["params"]]} for saved in groups
    ]
    optimizer.load_state_dict({"state": state, "param_groups": live_groups})


def _like(param: torch.Tensor, name: str, key: str, value: Any, meta: dict[str, Any] | None) -> Any:
    """Make a state tensor that belongs to ``param`` a DTensor laid out like it."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    value = value.to(param.device)
    if value.shape == param.shape:
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    if value.dim() == 0:  # per-parameter scalars such as Adam's step
        return value
    local = param.to_local().shape
    if value.shape != local:
        raise ValueError(
            f"optimizer state {name}:{key} has shape {tuple(value.shape)}, neither the full {tuple(param.shape)} "
            f"nor this rank's {tuple(local)}; consolidate the optimizer shards and load the result"
        )
    if meta is None:
        raise ValueError(f"optimizer state {name}:{key} is a local shard; pass the shard_metadata= saved with it")
    return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
