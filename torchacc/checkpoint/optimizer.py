"""Optimizer state keyed by parameter names, through torch's state-dict API, and TorchAcc's plain optimizer loads.

``optimizer.state_dict()`` keys state by position (0, 1, ...), which only means something next to the exact
optimizer that wrote it, and under FSDP holds this rank's shards. ``optim_state_dict`` and
``load_optim_state_dict`` are torch's ``get/set_optimizer_state_dict`` (keys: the model's parameter names,
without wrapper prefixes), plus what they lack: full tensors and local shards are cut to this rank's piece
without communication, state saved by position is accepted, and an optimizer that never stepped is not stepped.

[Note: plain optimizer loads] TorchAcc scripts save ``torchacc.save(optimizer.state_dict(), path)`` (the full
state, gathered) and later call ``optimizer.load_state_dict(torch.load(path))``. torch's own load keeps those
full tensors as plain tensors beside DTensor parameters, and the next step fails. ``watch_optimizers`` makes
that round trip exact: each optimizer over sharded parameters gets a load-state-dict pre-hook that shards full
tensors like their parameter (and refuses state it cannot map, naming the parameter); an optimizer that loaded
state before the hook was attached (one built after ``accelerate()`` gets it at its first step) has that state
sharded at its first step.
"""

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._utils.internal_steps import internal_optimizer_steps
from .._utils.tree import map_tensors
from ..parallel.accelerated import parameter_name, replaced_name
from .state import canonical_name, check_shard_metadata, dtensor_like

__all__ = ["optim_state_dict", "load_optim_state_dict", "named_parameters", "watch_optimizers", "attach_load_hook"]
__all__ += ["shard_like"]


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters under the names torch's state-dict API gives them (no wrapper prefixes)."""
    return {canonical_name(name): param for name, param in model.named_parameters()}


def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter name of each optimizer index, in ``optimizer.state_dict()`` order."""
    names = {param: name for name, param in named_parameters(model).items()}
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        if param not in names:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not in "
                f"{type(model).__name__}; build it from the accelerated model's parameters"
            )
    return [names[p] for group in optimizer.param_groups for p in group["params"]]


def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool = False) -> dict[str, Any]:
    """The optimizer's state keyed by parameter names (torch's ``get_optimizer_state_dict``).

    Args:
        model: the (accelerated) model the optimizer trains.
        optimizer: the optimizer.
        full: gather sharded state into full CPU tensors on every rank (a collective: every rank must call it);
            False keeps DTensors, which ``torchacc.save(..., master_only=False)`` stores as local shards.

    Returns:
        ``{"state": {param name: {key: value}}, "param_groups": [{..., "params": [param names]}]}``.

    Example:
        >>> shard = {"optimizer": torchacc.optim_state_dict(model, opt), "shard_metadata": model.get_shard_metadata()}
        >>> torchacc.save(shard, f"ckpt/rank-{rank}-of-{world}-optim.pth", master_only=False)
    """
    names = _names(model, optimizer)
    if not optimizer.state:  # torch's API would take a zero-gradient step to create it: Adam's step would count it
        groups = optimizer.state_dict()["param_groups"]
        return {"state": {}, "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}
    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full))
    return map_tensors(lambda t: t.detach().cpu(), osd) if full else osd


def load_optim_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    *,
    shard_metadata: dict[str, Any] | None = None,
) -> None:
    """Load optimizer state saved by ``optim_state_dict`` (full or sharded), or ``optimizer.state_dict()``.

    Full tensors are cut to this rank's shard without communication, so a consolidated optimizer state loads
    at any world size; local shards need the ``shard_metadata`` saved with them. Then torch's
    ``set_optimizer_state_dict`` loads it.

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
    names, params = _names(model, optimizer), named_parameters(model)
    _check_groups(optimizer, state_dict, "build the optimizer with the same parameter groups as the run that saved it")

    def name_of(key: Any) -> str:
        name = names[key] if isinstance(key, int) else canonical_name(key)
        if name not in params:
            raise ValueError(f"saved optimizer state for {name!r}, which is not a parameter of {type(model).__name__}")
        return name

    state = {}
    for key, values in state_dict["state"].items():
        name = name_of(key)
        state[name] = {k: shard_like(params[name], name, k, v, shard_metadata) for k, v in values.items()}
    groups = [{**g, "params": [name_of(n) for n in g["params"]]} for g in state_dict["param_groups"]]
    options = StateDictOptions(strict=False)  # a parameter without saved state (it never had a gradient) is fine
    with internal_optimizer_steps():  # torch creates an empty optimizer's state with a zero-gradient step
        set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=options)


def shard_like(param: torch.Tensor, name: str, key: str, value: Any, meta: dict[str, Any] | None = None) -> Any:
    """Make a state tensor that belongs to ``param`` a DTensor laid out like it (no communication).

    Raises:
        ValueError: ``value`` is neither a scalar, the full shape, nor (with ``meta``) this rank's shard.
    """
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if value.dim() == 0 and param.dim() > 0:  # per-parameter scalars such as Adam's step
        return value
    converted = dtensor_like(param, value, local=meta is not None)
    if converted is None:
        hint = "pass the shard_metadata= saved with it to" if value.shape == param.to_local().shape else "load it with"
        raise ValueError(
            f"optimizer state {name}:{key} has shape {tuple(value.shape)}, not the full shape {tuple(param.shape)} "
            f"of parameter {name!r}; it does not belong to this model's parameters: {hint} "
            "torchacc.load_optim_state_dict(model, optimizer, state, shard_metadata=...), or consolidate the "
            "optimizer shards first"
        )
    return converted


_watched: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_hooked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_step_hook_installed = False


def watch_optimizers() -> None:
    """Check every optimizer at its first step: refuse one built on replaced parameters, shard plain state.

    See [Note: plain optimizer loads]. Installed once per process by the engine when it shards a model.
    """
    global _step_hook_installed
    if not _step_hook_installed:
        register_optimizer_step_pre_hook(_first_step)
        _step_hook_installed = True


def attach_load_hook(optimizer: torch.optim.Optimizer) -> None:
    """Shard full tensors in every later ``optimizer.load_state_dict`` (see [Note: plain optimizer loads])."""
    if optimizer not in _hooked:
        optimizer.register_load_state_dict_pre_hook(_shard_loaded_state)
        _hooked.add(optimizer)


def _first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _watched:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:
        # Under FSDP2 an optimizer built before sharding updates parameters the model no longer uses:
        # the loss never moves and nothing says why (a known PyTorch trap).
        name = replaced_name(param)
        if name is not None:
            raise RuntimeError(
                f"this optimizer holds parameters that torchacc.accelerate() replaced by sharded ones (first: "
                f"{name!r}), so it would train nothing; build the optimizer after accelerate() from "
                "model.parameters(), or pass it in: accelerate(model, loader, config, optimizer=optimizer)"
            )
    if any(isinstance(p, DTensor) for p in params):
        for param in params:
            if state := optimizer.state.get(param):
                name = parameter_name(param)
                optimizer.state[param] = {k: shard_like(param, name, k, v) for k, v in state.items()}
        attach_load_hook(optimizer)
    _watched.add(optimizer)


def _shard_loaded_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(isinstance(p, DTensor) for p in params):
        return state_dict
    fix = "save it from this model's optimizer, or load name-keyed state with torchacc.load_optim_state_dict"
    _check_groups(optimizer, state_dict, fix, what="optimizer.load_state_dict: ")
    by_id = dict(zip((i for group in state_dict["param_groups"] for i in group["params"]), params, strict=True))
    state = {}
    for index, values in state_dict.get("state", {}).items():
        if (param := by_id.get(index)) is None:
            raise ValueError(
                f"optimizer.load_state_dict: state for parameter index {index!r}, which no group holds; {fix}"
            )
        name = parameter_name(param, f"#{index}")
        state[index] = {k: shard_like(param, name, k, v) for k, v in values.items()}
    return {**state_dict, "state": state}


def _check_groups(optimizer: torch.optim.Optimizer, state_dict: Any, fix: str, *, what: str = "") -> None:
    """Raise ValueError unless ``state_dict`` has param groups of the sizes of ``optimizer``'s."""
    try:
        sizes = [len(g["params"]) for g in state_dict["param_groups"]]
    except (KeyError, TypeError):
        raise ValueError(f"{what}not an optimizer state dict (no param_groups); {fix}") from None
    if sizes != (live := [len(g["params"]) for g in optimizer.param_groups]):
        raise ValueError(
            f"{what}the saved optimizer has param groups of sizes {sizes} but this one has {live}: it comes from "
            f"other parameters; {fix}"
        )
