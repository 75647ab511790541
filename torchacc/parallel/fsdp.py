"""Sharding a model with FSDP2 (``fully_shard``) or replicating it (DDP), from plain arguments.

Public as ``torchacc.dist.fsdp`` (with TorchAcc's consolidation helpers). This module knows nothing of
``Config``: ``accelerate()`` turns the config into the arguments here.
"""

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from .._utils.logging import warn_once
from .._utils.tied import tied_names

__all__ = [
    "resolve_module_classes",
    "plan_units",
    "check_units",
    "wrap_fsdp",
    "wrap_ddp",
    "is_wrapped",
]


def resolve_module_classes(model: nn.Module, names: Iterable[str], *, what: str) -> set[type[nn.Module]]:
    """Map class names to the module classes found in ``model``.

    Args:
        model: the model to search.
        names: class names such as ``{"GPT2Block"}``.
        what: how the caller calls this setting, used in the error (``"dist.fsdp.wrap_layer_cls"``).

    Returns:
        The classes, one per name.

    Raises:
        ValueError: a name matches no module of ``model``; the message lists the classes it has.
    """
    by_name: dict[str, type[nn.Module]] = {}
    for module in model.modules():
        by_name.setdefault(type(module).__name__, type(module))
    missing = sorted(set(names) - set(by_name))
    if missing:
        raise ValueError(
            f"{what}: no module of class {', '.join(repr(m) for m in missing)} in {type(model).__name__}; "
            f"the model contains: {', '.join(sorted(by_name))}; set {what} to names from this list"
        )
    return {by_name[name] for name in names}


def _modules_with_foreign_params(model: nn.Module, candidates: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """Candidates holding a parameter tied to one outside them, with that parameter's outside name."""
    pairs = list(tied_names(model.named_parameters(remove_duplicate=False)).items())
    tied: dict[str, str] = {}
    for name, _ in candidates:
        prefix = f"{name}."
        for alias, owner in pairs:
            if alias.startswith(prefix) != owner.startswith(prefix):
                tied[name] = owner if alias.startswith(prefix) else alias
                break
    return tied


def plan_units(
    model: nn.Module, layer_classes: Collection[type[nn.Module]], *, warn: bool = False
) -> list[tuple[str, nn.Module]]:
    """The modules that become FSDP units below the root, parents first (see ``wrap_fsdp``).

    A module whose parameter is tied to one outside it is left to its parent (with a warning when ``warn``).
    """
    classes = tuple(layer_classes)
    candidates = [(n, m) for n, m in model.named_modules() if m is not model and isinstance(m, classes)]
    for name, param_name in _modules_with_foreign_params(model, candidates).items():
        if warn:
            warn_once(
                f"not sharding {name} as its own unit: its parameter is tied to {param_name}, and tied weights "
                "must live in one FSDP group; it is sharded with its parent instead"
            )
        candidates = [(n, m) for n, m in candidates if n != name]
    return candidates


def check_units(model: nn.Module, layer_classes: Collection[type[nn.Module]]) -> None:
    """Raise ValueError (before any collective) for parameters FSDP2 cannot shard as ``wrap_fsdp`` would group them.

    FSDP2 all-gathers each unit's parameters as one buffer of one dtype, and cannot shard a parameter with
    no elements; both fail only at the first forward or backward, with an upstream error.
    """
    unit_names = {name for name, _ in plan_units(model, layer_classes)}
    dtypes: dict[str, dict[torch.dtype, str]] = {}
    for name, param in model.named_parameters():
        if param.numel() == 0:
            raise ValueError(
                f"parameter {name!r} has no elements (shape {tuple(param.shape)}), which FSDP2 cannot shard; remove "
                "it, or register it as a buffer (module.register_buffer) if it is not trained"
            )
        dtypes.setdefault(_innermost_unit(name, unit_names), {}).setdefault(param.dtype, name)
    for unit_name, found in dtypes.items():
        if len(found) > 1:
            listing = ", ".join(f"{str(dtype).removeprefix('torch.')} ({name})" for dtype, name in found.items())
            raise ValueError(
                f"dist.fsdp.wrap_layer_cls: the FSDP unit {unit_name or 'root'!r} holds parameters of different "
                f"dtypes: {listing}; FSDP2 all-gathers a unit's parameters as one buffer of one dtype: cast the "
                "model to one dtype before accelerate() (compute.bf16 keeps float32 weights and computes in bf16), "
                "or add the odd submodule's class to dist.fsdp.wrap_layer_cls so that it becomes a unit of its own"
            )


def _innermost_unit(param_name: str, unit_names: set[str]) -> str:
    """The innermost of ``unit_names`` that holds the parameter ``param_name`` ("" for the root): a nested unit
    takes its parameters over from its parent, as ``fully_shard`` bottom-up does."""
    parts = param_name.split(".")[:-1]
    for depth in range(len(parts), 0, -1):
        prefix = ".".join(parts[:depth])
        if prefix in unit_names:
            return prefix
    return ""


def wrap_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    layer_classes: Collection[type[nn.Module]],
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int = True,
    offload_policy: OffloadPolicy | None = None,
    forward_prefetch: int = 0,
    backward_prefetch: int = 0,
    roots: Sequence[nn.Module] | None = None,
) -> nn.Module:
    """Shard ``model`` in place: every module of ``layer_classes`` bottom-up, then the root.

    Each wrapped module becomes one FSDP unit: its parameters are all-gathered just before its
    forward and freed after. Parameters outside every unit (embeddings, final norm, head) belong to
    the root unit. A unit whose parameters are tied to a module outside it (GPT-2's ``wte`` and
    ``lm_head``) is left to its parent, because tied weights must live in one FSDP group.

    Args:
        model: the model, on any device (or the meta device); its parameter names are unchanged.
        mesh: a 1-D mesh (FSDP) or a 2-D ``(replicate, shard)`` mesh (HSDP).
        layer_classes: module classes to make units of (resolve names with ``resolve_module_classes``).
        mp_policy: FSDP2 mixed precision; defaults to the parameters' own dtype with float32 reduction.
        reshard_after_forward: free each unit's gathered parameters after forward (True), keep them for backward
            (False), or reshard to groups of that many ranks (int). The root (or each of ``roots``) always keeps
            its parameters gathered from forward to backward (FSDP2's own default for a root, as in TorchTitan):
            backward needs them first, and FSDP2 re-gathers a unit for backward only through hooks on the
            tensors of its output, which a root returning a plain object (no tensors) does not have. After a
            forward without gradients (no backward follows) the root is resharded at once.
        offload_policy: e.g. ``CPUOffloadPolicy()`` to keep shards in CPU memory (CUDA runs).
        forward_prefetch: explicitly all-gather the next N units during forward (0: FSDP2's default).
        backward_prefetch: explicitly all-gather the next N units during backward (0: FSDP2's default).
        roots: shard these modules last, in place of ``model`` (the stages of a pipelined model, which hold its
            parameters between them); ``model`` itself then stays a plain module.

    Returns:
        ``model`` itself, an ``FSDPModule`` (unless ``roots`` are given) whose parameters are DTensors.

    Example:
        >>> wrap_fsdp(model, mesh, {GPT2Block}, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    """
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    candidates = plan_units(model, layer_classes, warn=True)
    # named_modules() lists parents before children, so the reverse shards children first.
    for _, module in reversed(candidates):
        fully_shard(module, **kwargs)
    for root in [model] if roots is None else roots:
        fully_shard(root, **{**kwargs, "reshard_after_forward": None})  # None: a root keeps them gathered
        root.register_forward_hook(_reshard_without_backward)
        # a unit prefetches the next units of its own root only (a pipeline stage's blocks); a set: a scan of
        # root.modules() per unit was quadratic in the model's modules
        inside = {id(sub) for sub in root.modules()}
        units = [m for _, m in candidates if id(m) in inside]
        _set_prefetch(units, forward=forward_prefetch, backward=backward_prefetch)
    return model


def _reshard_without_backward(module: FSDPModule, args: Any, output: Any) -> None:
    # A root kept gathered for backward is freed by its post-backward; a forward without gradients (evaluation,
    # generate()) has no backward, so its parameters are freed here, as every other unit's are after forward.
    if not torch.is_grad_enabled():
        module.reshard()


def _set_prefetch(units: list[nn.Module], *, forward: int, backward: int) -> None:
    """Explicit prefetching: each unit starts the all-gather of the next ``forward`` units (in forward order)
    and of the previous ``backward`` units (in backward order)."""
    for i, unit in enumerate(units):
        if forward:
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + forward])
        if backward:
            unit.set_modules_to_backward_prefetch(list(reversed(units[max(0, i - backward) : i])))


def wrap_ddp(model: nn.Module, *, sync_module_states: bool = True, broadcast_buffers: bool = True) -> nn.Module:
    """Replicate ``model`` across all ranks with DDP gradient all-reduce, keeping its parameter names.

    Args:
        model: the model, already on this rank's device.
        sync_module_states: broadcast rank 0's parameters and buffers first.
        broadcast_buffers: broadcast rank 0's buffers before every forward (DDP's knob).

    Returns:
        ``model`` itself, with DDP's gradient hooks installed.
    """
    # The composable replicate() is DDP without the wrapper class, so state_dict keys get no "module." prefix.
    from torch.distributed._composable import replicate

    return replicate(model, init_sync=sync_module_states, broadcast_buffers=broadcast_buffers)


def is_wrapped(model: nn.Module) -> bool:
    """True when ``model`` or one of its submodules is already sharded by FSDP2."""
    return any(isinstance(m, FSDPModule) for m in model.modules())
