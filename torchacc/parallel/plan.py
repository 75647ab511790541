"""Everything about a model that can be checked before any collective: ``plan_model``, and the mesh.

``plan_model`` resolves the wrap and checkpoint classes, checks meta-device models, FSDP units and a
passed optimizer, and raises the same ``ValueError`` on every rank; ``make_mesh`` builds the mesh.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import Config
from ..distributed.mesh import build_mesh
from .fsdp import check_units, is_wrapped, resolve_module_classes
from .meta_init import check_materializable, has_meta_params
from .tp import TPPlan, resolve_tp_plan

__all__ = ["ModelPlan", "plan_model", "make_mesh"]


@dataclass(frozen=True)
class ModelPlan:
    """The resolved classes and checks for one model; built before any collective."""

    wrap_classes: frozenset[type[nn.Module]]
    gc_classes: frozenset[type[nn.Module]]
    meta: bool
    tp: TPPlan | None = None


def plan_model(model: nn.Module, config: Config, *, optimizer: torch.optim.Optimizer | None = None) -> ModelPlan:
    """Check ``model`` (and ``optimizer``) against ``config``; no communication.

    Raises:
        ValueError: an already accelerated model, an unknown wrap or checkpoint class (listing the model's
            classes), a meta-device model that cannot be initialized, a TP plan that does not fit the model,
            an optimizer holding other parameters.
        TypeError: ``optimizer`` is not an optimizer.
    """
    if hasattr(model, "_torchacc") or is_wrapped(model):
        raise ValueError(
            f"{type(model).__name__} is already accelerated (sharded or replicated); call torchacc.accelerate() "
            "once per model, on the plain model"
        )
    meta = has_meta_params(model)
    if meta:
        check_materializable(model, config.dist.fsdp.init_from)
    elif any(b.is_meta for b in model.buffers()):
        check_materializable(model, None)
    wrap = resolve_module_classes(model, config.dist.fsdp.wrap_layer_cls, what="dist.fsdp.wrap_layer_cls")
    gc: set[type[nn.Module]] = set()
    if config.memory.gc:
        what = "memory.gc_cls" if config.memory.gc_cls else "dist.fsdp.wrap_layer_cls"
        gc = resolve_module_classes(model, config.memory.gc_cls or config.dist.fsdp.wrap_layer_cls, what=what)
    if config.dist.fsdp.size > 1:
        check_units(model, wrap)
    if config.compute.compile and not wrap:
        raise ValueError("compute.compile=True compiles each dist.fsdp.wrap_layer_cls block; set wrap_layer_cls too")
    tp = None
    if config.dist.tp.size > 1:
        tp = resolve_tp_plan(
            model, config.dist.tp.plan, size=config.dist.tp.size, sequence_parallel=config.dist.tp.sequence_parallel
        )
    names = {param: name for name, param in model.named_parameters()}
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        foreign = [p for group in optimizer.param_groups for p in group["params"] if p not in names]
        if foreign:
            raise ValueError(
                f"optimizer holds {len(foreign)} parameter(s) that are not parameters of {type(model).__name__} "
                f"(first has shape {tuple(foreign[0].shape)}); build the optimizer from model.parameters()"
            )
    return ModelPlan(frozenset(wrap), frozenset(gc), meta, tp)


def make_mesh(config: Config, *, world_size: int, device: torch.device) -> DeviceMesh | None:
    """The job's mesh (see ``torchacc.distributed.mesh``), or None when nothing is sharded or split (plain DP, or
    one process)."""
    if config.dist.fsdp.size == 1 and config.dist.tp.size == 1:
        return None
    return build_mesh(
        device_type=device.type,
        dp_size=config.resolved_dp_size(world_size),
        fsdp_size=config.dist.fsdp.size,
        tp_size=config.dist.tp.size,
        topology=config.dist.topology,
    )
