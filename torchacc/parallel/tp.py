"""Tensor parallelism: resolve ``dist.tp.plan`` to DTensor styles, check it against the model, apply it.

``resolve_tp_plan`` runs before any collective and raises the same ``ValueError`` on every rank;
``apply_tp`` calls ``parallelize_module`` on the ``tp`` mesh, before activation checkpointing and
``fully_shard`` (TorchTitan's order).

[Note: sequence parallelism] With ``sequence_parallel`` the residual stream between the first TP block
and the final norm holds 1/tp of the tokens: the input of the first block is split along the sequence
(a local slice, no communication), norms run on the local tokens (``SequenceParallel``), the module
that holds ``colwise`` layers (attention, MLP) all-gathers the tokens once on entry, as a replicated
DTensor (so its own shape arithmetic sees the full sequence and the backward reduce-scatters), and
every ``rowwise`` layer reduce-scatters its output (instead of an all-reduce). Embeddings, attention
masks and position ids are built on the full sequence before the split, which keeps Hugging Face
models working unchanged.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .._utils.logging import warn_once
from .._utils.tied import retie, tied_names

__all__ = ["STYLES", "TPPlan", "resolve_tp_plan", "apply_tp"]

STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "sequence_parallel")
_ALIASES = {"colwise_rep": "colwise_gather_output", "local_colwise": "colwise", "local_rowwise": "rowwise"}
# internal styles of [Note: sequence parallelism]
_SPLIT = "split_sequence"  # the input of the first TP block: keep this rank's tokens
_GATHER = "gather_sequence"  # the input of an attention or MLP module: all-gather the tokens (as a DTensor)
_COLWISE_SEQ = "colwise_sequence"  # a colwise layer whose parent gathers nothing: it all-gathers itself


@dataclass(frozen=True)
class TPPlan:
    """A checked plan: exact module names -> style, in module order."""

    styles: dict[str, str]
    sequence_parallel: bool


def _pattern(pattern: str) -> re.Pattern[str]:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", pattern)))


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


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


def _check_module(name: str, module: nn.Module, style: str, size: int) -> None:
    kind = type(module).__name__
    if kind == "Conv1D":
        raise ValueError(
            f"dist.tp.plan: {name} is a transformers Conv1D (GPT-2 style, weight stored transposed), which has no "
            "tensor-parallel style; use FSDP for this model (dist.tp.size=1), or replace Conv1D by nn.Linear"
        )
    if style == "sequence_parallel":
        return
    if style == "embedding_rowwise" or (style == "rowwise" and isinstance(module, nn.Embedding)):
        if not isinstance(module, nn.Embedding):
            raise ValueError(
                f"dist.tp.plan: {name} is a {kind}, but 'embedding_rowwise' splits an nn.Embedding; use 'colwise' or "
                "'rowwise' for an nn.Linear"
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
    features = module.in_features if style == "rowwise" else module.out_features
    if features % size:
        what = "in_features" if style == "rowwise" else "out_features"
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
    if style in ("colwise", "colwise_gather_output", "embedding_rowwise"):
        return 0
    if style == "rowwise":
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


def _add_sequence_parallel(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """The plan with the norms and the sequence split of [Note: sequence parallelism] added."""
    blocks = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and any(s.startswith(f"{name}.") for s in styles):
            blocks = (name, module)
            break
    if blocks is None or len(blocks[1]) == 0:
        raise ValueError(
            "dist.tp.sequence_parallel=True needs the TP layers inside a list of blocks (an nn.ModuleList such as "
            f"model.layers); none of {type(model).__name__}'s module lists holds a module of dist.tp.plan"
        )
    list_name, _ = blocks
    heads = [n for n, style in styles.items() if style == "colwise_gather_output" and not n.startswith(list_name)]
    if not heads:
        raise ValueError(
            "dist.tp.sequence_parallel=True leaves each rank with its own tokens after the last block, so the output "
            "layer must gather them: add it to dist.tp.plan as 'colwise_gather_output' (e.g. 'lm_head': "
            "'colwise_gather_output'), or set dist.tp.sequence_parallel=False"
        )
    parent = list_name.rpartition(".")[0]
    extra = {f"{list_name}.0": _SPLIT}
    for name, style in styles.items():
        holder = name.rpartition(".")[0]
        if style == "colwise" and name.startswith(f"{list_name}."):
            # the holder is a block itself when the colwise layer sits directly in it: gather in the layer then
            block_level = holder.count(".") == list_name.count(".") + 1
            extra[name] = _COLWISE_SEQ if block_level else "colwise"
            if not block_level:
                extra[holder] = _GATHER
    for name, module in model.named_modules():
        inside = name.startswith(f"{list_name}.")
        after = name.rpartition(".")[0] == parent and not inside and name != list_name
        if _is_norm(module) and (inside or after):
            extra[name] = "sequence_parallel"
    return {**styles, **extra}


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
            model's attention heads) ``size`` does not divide.
    """
    raw = _raw_plan(model, plan)
    modules = dict(model.named_modules())
    styles: dict[str, str] = {}
    for pattern, style in raw.items():
        style = _ALIASES.get(style, style)
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
    if sequence_parallel:
        styles = _add_sequence_parallel(model, styles)
    order = {name: i for i, name in enumerate(modules)}
    return TPPlan(dict(sorted(styles.items(), key=lambda item: order[item[0]])), sequence_parallel)


def _gather_sequence(mesh: DeviceMesh):
    """A pre-hook that turns the module's hidden states (the first argument, or ``hidden_states=``) from this
    rank's tokens into a DTensor of all tokens (an all-gather; its backward reduce-scatters)."""

    def gather(x: torch.Tensor) -> DTensor:
        return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

    return hook


def _style(style: str, module: nn.Module, sp: bool):
    seq = Shard(1)
    if style == "colwise":
        return ColwiseParallel()
    if style == _COLWISE_SEQ:
        return ColwiseParallel(input_layouts=seq)
    if style == "colwise_gather_output":
        return ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Replicate())
    if style == "embedding_rowwise" or (style == "rowwise" and isinstance(module, nn.Embedding)):
        return RowwiseParallel(input_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel(output_layouts=seq) if sp else RowwiseParallel()
    if style == "sequence_parallel":
        return SequenceParallel(use_local_output=True) if sp else None
    if style == _GATHER:
        return _GATHER
    # _SPLIT: cut the replicated hidden states down to this rank's tokens (a slice)
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True)


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: TPPlan) -> None:
    """Split the modules of ``plan`` over the 1-D ``mesh`` (``parallelize_module``), keeping tied weights tied.

    Every rank of ``mesh`` must call it with the same plan. Parameters become DTensors on ``mesh``;
    modules outside the plan keep plain (replicated) parameters.
    """
    tied = tied_names(model.named_parameters(remove_duplicate=False))
    parallel = {}
    for name, style in plan.styles.items():
        module = model.get_submodule(name)
        tp_style = _style(style, module, plan.sequence_parallel)
        if tp_style is not None:
            parallel[name] = tp_style
    for name, tp_style in parallel.items():
        if tp_style == _GATHER:
            model.get_submodule(name).register_forward_pre_hook(_gather_sequence(mesh), with_kwargs=True)
        else:
            parallelize_module(model.get_submodule(name), mesh, tp_style)
    retie(model, tied)  # each module of a tied pair got its own DTensor; _check_ties made them alike
