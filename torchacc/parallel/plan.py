"""Everything about a model that can be checked before any collective: ``plan_model``.

``plan_model`` resolves the layout's wrap and checkpoint class names to the model's classes, checks meta-device
models, FSDP units, the TP plan, the pipeline split and a passed optimizer, and raises the same ``ValueError`` on
every rank.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from .accelerated import accelerated_state
from .context_plan import CPPlan, resolve_context_parallel
from .fsdp import check_units, is_wrapped, resolve_module_classes
from .layout import Layout
from .meta_init import check_materializable, has_meta_params
from .pipeline import StagePlan, plan_pipeline
from .tp import STYLES, TPPlan, resolve_tp_plan

__all__ = ["ModelPlan", "plan_model"]


@dataclass(frozen=True)
class ModelPlan:
    """The resolved classes and checks for one model; built before any collective."""

    wrap_classes: frozenset[type[nn.Module]]
    gc_classes: frozenset[type[nn.Module]]
    meta: bool
    tp: TPPlan | None = None
    pp: StagePlan | None = None
    cp: CPPlan | None = None


def plan_model(
    model: nn.Module, layout: Layout, *, optimizer: torch.optim.Optimizer | None = None, materialize: bool = True
) -> ModelPlan:
    """Check ``model`` (and ``optimizer``) against ``layout``; no communication.

    ``materialize=False`` is the planner's dry run (see [Note: dry run] in engine.py): its model never gets
    values, so a meta-device model need not be one that can be initialized.

    Raises:
        ValueError: an already accelerated model, an unknown wrap or checkpoint class (listing the model's
            classes), a meta-device model that cannot be initialized, a TP plan that does not fit the model,
            a pipeline split that does not fit the model (see ``plan_pipeline``), an optimizer holding other
            parameters, a model whose attention context parallelism cannot split.
        TypeError: ``optimizer`` is not an optimizer.
    """
    if accelerated_state(model) is not None or is_wrapped(model):
        raise ValueError(
            f"{type(model).__name__} is already accelerated (sharded or replicated); call torchacc.accelerate() "
            "once per model, on the plain model"
        )
    meta = has_meta_params(model)
    if materialize and meta:
        check_materializable(model, layout.init_from)
    elif materialize and any(b.is_meta for b in model.buffers()):
        check_materializable(model, None)
    wrap = resolve_module_classes(model, set(layout.wrap_layer_cls), what="dist.fsdp.wrap_layer_cls")
    gc: set[type[nn.Module]] = set()
    checkpointing = layout.checkpointing
    if checkpointing is not None:
        gc = resolve_module_classes(model, set(checkpointing.class_names), what=checkpointing.source)
    if layout.dims.fsdp * layout.dims.cp > 1:  # with CP, fully_shard shards over fsdp x cp
        check_units(model, wrap)
    if layout.compile and not wrap:
        raise ValueError("compute.compile=True compiles each dist.fsdp.wrap_layer_cls block; set wrap_layer_cls too")
    tp = None
    if layout.dims.tp > 1:
        tp = resolve_tp_plan(model, layout.tp_plan, size=layout.dims.tp, sequence_parallel=layout.sequence_parallel)
        if layout.compile:
            _check_compile_with_tp(model, tp, wrap, size=layout.dims.tp)
    pp = None
    if layout.pipeline is not None:
        schedule = layout.pipeline
        pp = plan_pipeline(model, num_stages=schedule.num_stages, split=schedule.split, wrap_classes=frozenset(wrap))
    cp = None
    if layout.dims.cp > 1:
        cp = resolve_context_parallel(model, size=layout.dims.cp, method=layout.cp_method, tp_size=layout.dims.tp)
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        names = {param: name for name, param in model.named_parameters()}
        foreign = [p for group in optimizer.param_groups for p in group["params"] if p not in names]
        if foreign:
            raise ValueError(
                f"optimizer holds {len(foreign)} parameter(s) that are not parameters of {type(model).__name__} "
                f"(first has shape {tuple(foreign[0].shape)}); build the optimizer from model.parameters()"
            )
    return ModelPlan(frozenset(wrap), frozenset(gc), meta, tp, pp, cp)


def _check_compile_with_tp(model: nn.Module, tp: TPPlan, blocks: set[type[nn.Module]], *, size: int) -> None:
    """Refuse compiled blocks under a TP plan that also splits a layer outside them (Llama's own plan: lm_head).

    That shape fails in the first backward inside DTensor's ``Redistribute.backward``, which is handed a plain
    gradient instead of a DTensor (torch 2.13, gloo; the cause is not pinned down); a plan that splits only
    layers inside the compiled blocks trains like one process.
    """
    inside = {name for name, m in model.named_modules() if isinstance(m, tuple(blocks))}
    splits = [name for name, style in tp.styles.items() if style in STYLES[:5]]
    outside = [n for n in splits if not any(n.startswith(f"{block}.") for block in inside)]
    if outside and len(outside) < len(splits):
        raise ValueError(
            f"compute.compile=True with dist.tp.size={size}: dist.tp.plan splits {', '.join(outside)} outside the "
            "compiled dist.fsdp.wrap_layer_cls blocks as well as layers inside them, which fails in the first "
            "backward (DTensor's Redistribute.backward gets a plain gradient); keep only the layers inside the "
            "blocks in dist.tp.plan (e.g. {'model.layers.*.mlp.down_proj': 'rowwise', ...} without "
            f"{outside[-1]!r}), or set compute.compile=False"
        )
