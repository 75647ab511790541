"""Tensor parallelism: resolve ``dist.tp.plan`` to DTensor styles, check it against the model, apply it.

``resolve_tp_plan`` runs before any collective and raises the same ``ValueError`` on every rank;
``apply_tp`` calls ``parallelize_module`` on the ``tp`` mesh, before activation checkpointing and
``fully_shard`` (TorchTitan's order).

Sequence parallelism is in tp_sequence.py ([Note: sequence parallelism]). Which parameters of the plan's
modules stay whole but need their gradient summed over the TP group, and which layers must not be split
``colwise``, is in tp_region.py ([Note: the split region]); the TP ranks' random numbers in tp_rng.py.
"""

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .._utils.logging import warn_once
from .._utils.tied import retie, tied_names
from .tp_region import add_region_styles, check_packed_layers, check_pairs
from .tp_sequence import COLWISE_SEQ, GATHER, SPLIT, add_sequence_parallel, gather_sequence, sequence_check

__all__ = ["STYLES", "TPPlan", "resolve_tp_plan", "apply_tp"]

# the styles that split a weight, then those that keep it whole
STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise")
STYLES += ("replicated_with_grad_allreduce", "replicate", "sequence_parallel")
# transformers' names for some of them
_ALIASES = {"colwise_rep": "colwise_gather_output", "rowwise_rep": "rowwise_split_input"}
_ALIASES |= {"local_colwise": "colwise", "local_rowwise": "rowwise"}
_EMBEDDING = "embedding_rowwise"


@dataclass(frozen=True)
class TPPlan:
    """A checked plan: exact module names -> style, in module order."""

    styles: dict[str, str]
    sequence_parallel: bool


def _pattern(pattern: str) -> re.Pattern[str]:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", pattern)))


def _raw_plan(model: nn.Module, plan: str | Mapping[str, str]) -> dict[str, str]:
    if not isinstance(plan, str):
        return dict(plan)
    auto = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not auto:
        raise ValueError(
            f"dist.tp.plan='auto' takes a Hugging Face model's own plan (config.base_model_tp_plan), but "
            f"{type(model).__name__} has none; pass a mapping of module-name patterns to styles instead, e.g. "
            "dist.tp.plan={'layers.*.mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': 'rowwise'}"
        )
    return dict(auto)


_SUPER_FORWARD = re.compile(r"super\([^)]*\)\.forward\(")


def _own_lookup(cls: type[nn.Module]) -> str | None:
    """Why ``cls`` (an nn.Embedding subclass) does its own lookup, or None when every forward it overrides only
    post-processes ``super().forward(...)`` (Gemma's scaled embeddings) without touching local tensors."""
    for klass in cls.__mro__[: cls.__mro__.index(nn.Embedding)]:
        if "forward" not in vars(klass):
            continue
        try:
            source = inspect.getsource(vars(klass)["forward"])
        except (OSError, TypeError):
            return f"({klass.__name__}.forward) has no source to inspect"
        if "to_local" in source or "_local_tensor" in source:
            return f"({klass.__name__}.forward) works on a local tensor (to_local)"
        if not _SUPER_FORWARD.search(source):
            return f"({klass.__name__}.forward) does not look the ids up through super().forward"
    return None


def _check_module(name: str, module: nn.Module, style: str, size: int) -> None:
    kind = type(module).__name__
    if kind == "Conv1D":
        raise ValueError(
            f"dist.tp.plan: {name} is a transformers Conv1D (GPT-2 style, weight stored transposed), which has no "
            "tensor-parallel style; use FSDP for this model (dist.tp.size=1), or replace Conv1D by nn.Linear"
        )
    if style in ("sequence_parallel", "replicate"):
        return
    if style == "replicated_with_grad_allreduce":
        own = any(True for _ in module.parameters(recurse=False))
        if not own or any(True for child in module.children() for _ in child.parameters()):
            has = "parameters in its submodules" if own else "no parameters of its own"
            raise ValueError(
                f"dist.tp.plan: {name} is a {kind} with {has}; 'replicated_with_grad_allreduce' keeps the "
                "parameters of one module whole (a norm) and sums their gradients over the TP ranks: point the "
                "pattern at the module that holds them"
            )
        return
    if style == _EMBEDDING or (style == "rowwise" and isinstance(module, nn.Embedding)):
        if not isinstance(module, nn.Embedding):
            raise ValueError(
                f"dist.tp.plan: {name} is a {kind}, but 'embedding_rowwise' splits an nn.Embedding; use 'colwise' or "
                "'rowwise' for an nn.Linear"
            )
        if reason := _own_lookup(type(module)):
            raise ValueError(
                f"dist.tp.plan: {name} is a {kind}, an nn.Embedding subclass whose forward {reason}; '{style}' splits "
                "the vocabulary and needs the lookup to run in nn.Embedding.forward on the split (DTensor) weight, "
                "which a forward of its own bypasses (it fails inside DTensor, or reads only this rank's rows); "
                "leave it out of dist.tp.plan (it stays whole over the TP ranks, and FSDP shards it), or use "
                "nn.Embedding"
            )
        if module.num_embeddings % size:
            raise ValueError(
                f"dist.tp.plan: {name} has {module.num_embeddings} embeddings, not divisible by dist.tp.size={size}; "
                "pad the vocabulary to a multiple of the TP size, or leave this module out of the plan"
            )
        return
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"dist.tp.plan: {name} is a {kind}; style {style!r} splits nn.Linear layers (and 'embedding_rowwise' an "
            "nn.Embedding): point the pattern at the Linear layers inside it"
        )
    rowwise = style in ("rowwise", "rowwise_split_input")
    features = module.in_features if rowwise else module.out_features
    if features % size:
        what = "in_features" if rowwise else "out_features"
        raise ValueError(
            f"dist.tp.plan: {name} ({style}) has {what}={features}, not divisible by dist.tp.size={size}; choose a "
            "TP size that divides it, or leave this module out of the plan"
        )


def _check_heads(model: nn.Module, size: int) -> None:
    hf_config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(hf_config, field, None)
        if isinstance(heads, int) and heads % size:
            choices = [n for n in range(1, heads + 1) if heads % n == 0]
            raise ValueError(
                f"dist.tp.size={size} does not divide {field}={heads} of {type(hf_config).__name__}: each TP rank must "
                f"hold whole attention heads; choose dist.tp.size in {choices}"
            )


def _weight_split(module: nn.Module, style: str | None) -> int | None:
    """The dimension of ``module.weight`` that ``style`` splits (None: kept whole)."""
    if style in ("colwise", "colwise_gather_output", _EMBEDDING):
        return 0
    if style in ("rowwise", "rowwise_split_input"):
        return 0 if isinstance(module, nn.Embedding) else 1
    return None


def _check_ties(model: nn.Module, styles: dict[str, str], *, auto: bool) -> dict[str, str]:
    """Tied weights (an LM head sharing the embedding) must be split alike, or not at all."""
    for alias, owner in tied_names(model.named_parameters(remove_duplicate=False)).items():
        names = [name.rpartition(".")[0] for name in (owner, alias)]
        splits = [_weight_split(model.get_submodule(n), styles.get(n)) for n in names]
        if splits[0] == splits[1]:
            continue
        if not auto:
            raise ValueError(
                f"dist.tp.plan splits {names[0]} and {names[1]} differently, but they share one weight ({owner}); "
                "give both the same style (e.g. 'embedding_rowwise' and 'colwise_gather_output'), or neither"
            )
        warn_once(
            f"dist.tp.plan='auto': {names[0]} and {names[1]} share one weight ({owner}) but the model's plan splits "
            "them differently; both stay whole (replicated over the TP ranks)"
        )
        styles = {n: s for n, s in styles.items() if n not in names}
    return styles


def resolve_tp_plan(
    model: nn.Module, plan: str | Mapping[str, str], *, size: int, sequence_parallel: bool = False
) -> TPPlan:
    """Match ``plan`` against ``model``'s module names and check every match; no communication.

    Args:
        model: the plain model (on any device, meta included).
        plan: ``"auto"`` (the Hugging Face model's ``tp_plan``) or ``{pattern: style}``; ``*`` matches one name.
        size: ``dist.tp.size``.
        sequence_parallel: split the activations between TP layers along the sequence too.

    Returns:
        A ``TPPlan`` naming every module to split and its style.

    Raises:
        ValueError: no plan for the model, an unknown style, a pattern that matches no module (the message
            lists the model's Linear layers), a module that the style cannot split or whose size (or the
            model's attention heads) ``size`` does not divide, a packed layer marked ``colwise``, a module
            whose place in the split region the structure does not settle (see tp_region.py).
    """
    raw = _raw_plan(model, plan)
    modules = dict(model.named_modules())
    styles: dict[str, str] = {}
    for pattern, style in raw.items():
        style = _ALIASES.get(style, style)
        if style == "packed_colwise":
            raise ValueError(
                f"dist.tp.plan[{pattern!r}]='packed_colwise' (a layer holding several projections) is not supported; "
                "use 'colwise_gather_output' for the packed layer and 'rowwise_split_input' for the layer that reads "
                "its output (or leave both out of the plan)"
            )
        if style not in STYLES:
            raise ValueError(
                f"dist.tp.plan[{pattern!r}]={style!r} is not a supported style; use one of {', '.join(STYLES)} "
                "(a model whose plan needs others, such as Mixtral's packed experts, needs a hand-written plan)"
            )
        regex = _pattern(pattern)
        matched = [name for name in modules if name and regex.fullmatch(name)]
        if not matched:
            linears = [n for n, m in modules.items() if isinstance(m, (nn.Linear, nn.Embedding))][:8]
            raise ValueError(
                f"dist.tp.plan: pattern {pattern!r} matches no module of {type(model).__name__}; module names are "
                f"relative to the model passed to accelerate(), e.g. {', '.join(linears) or 'none'}"
            )
        for name in matched:
            _check_module(name, modules[name], style, size)
            styles[name] = style
    if any(style != "sequence_parallel" for style in styles.values()):
        _check_heads(model, size)
    styles = _check_ties(model, styles, auto=isinstance(plan, str))
    check_packed_layers(model, styles)
    check_pairs(model, styles)
    styles = add_region_styles(model, styles)
    if sequence_parallel:
        styles = add_sequence_parallel(model, styles)
    order = {name: i for i, name in enumerate(modules)}
    return TPPlan(dict(sorted(styles.items(), key=lambda item: order[item[0]])), sequence_parallel)


def _style(style: str, module: nn.Module, sp: bool):
    seq = Shard(1)
    if style == "colwise":
        return ColwiseParallel()
    if style == COLWISE_SEQ:
        return ColwiseParallel(input_layouts=seq)
    if style == "colwise_gather_output":
        return ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Replicate())
    if style == _EMBEDDING or (style == "rowwise" and isinstance(module, nn.Embedding)):
        return RowwiseParallel(input_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel(output_layouts=seq) if sp else RowwiseParallel()
    if style == "rowwise_split_input":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate())
    if style == "sequence_parallel":
        return SequenceParallel(use_local_output=True) if sp else None
    if style == "replicated_with_grad_allreduce":
        # The parameters become DTensors replicated over the TP ranks and the input is marked as split along
        # dim 0 (any dim but the normalized one would do): the weight's gradient then comes out partial and
        # DTensor all-reduces it. Under FSDP the parameters are sharded like any other DTensor's.
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    if style == "replicate":
        return None
    if style == GATHER:
        return GATHER
    # SPLIT: cut the replicated hidden states down to this rank's tokens (a slice)
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True)


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: TPPlan) -> None:
    """Split the modules of ``plan`` over the 1-D ``mesh`` (``parallelize_module``), keeping tied weights tied.

    Every rank of ``mesh`` must call it with the same plan. Parameters become DTensors on ``mesh``;
    modules outside the plan keep plain (replicated) parameters; ``replicated_with_grad_allreduce``
    modules get parameters replicated over ``mesh`` whose gradients are summed over it.
    """
    tied = tied_names(model.named_parameters(remove_duplicate=False))
    parallel = {}
    for name, style in plan.styles.items():
        module = model.get_submodule(name)
        tp_style = _style(style, module, plan.sequence_parallel)
        if tp_style is not None:
            parallel[name] = tp_style
    for name, tp_style in parallel.items():
        module = model.get_submodule(name)
        if tp_style == GATHER:
            module.register_forward_pre_hook(gather_sequence(mesh), with_kwargs=True)
        else:
            parallelize_module(module, mesh, tp_style)
        if plan.styles[name] == SPLIT:  # before the split: an uneven one fails later, in a collective
            module.register_forward_pre_hook(
                sequence_check(mesh.size(), tokens_only=False), prepend=True, with_kwargs=True
            )
    retie(model, tied)  # each module of a tied pair got its own DTensor; _check_ties made them alike
