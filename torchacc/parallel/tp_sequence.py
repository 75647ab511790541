"""Sequence parallelism: the residual stream between TP blocks holds this rank's tokens only.

[Note: sequence parallelism] With ``sequence_parallel`` the residual stream between the first TP block
and the final norm holds 1/tp of the tokens: the input of the first block is split along the sequence
(a local slice, no communication), norms run on the local tokens (``SequenceParallel``), the module
that holds ``colwise`` layers (attention, MLP) all-gathers the tokens once on entry, as a replicated
DTensor (so its own shape arithmetic sees the full sequence and the backward reduce-scatters), and
every ``rowwise`` layer reduce-scatters its output (instead of an all-reduce). Embeddings, attention
masks and position ids are built on the full sequence before the split, which keeps Hugging Face
models working unchanged.

``check_sequence_length`` refuses, before anything communicates, a sequence that the TP ranks cannot
split evenly (the split would be uneven, and the first reduce-scatter would fail or hang).
"""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .tp_region import is_norm

__all__ = [
    "SPLIT",
    "GATHER",
    "COLWISE_SEQ",
    "add_sequence_parallel",
    "gather_sequence",
    "check_sequence_length",
    "sequence_check",
    "install_sequence_check",
]

# internal styles of [Note: sequence parallelism]
SPLIT = "split_sequence"  # the input of the first TP block: keep this rank's tokens
GATHER = "gather_sequence"  # the input of an attention or MLP module: all-gather the tokens (as a DTensor)
COLWISE_SEQ = "colwise_sequence"  # a colwise layer whose parent gathers nothing: it all-gathers itself


def add_sequence_parallel(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
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
    extra = {f"{list_name}.0": SPLIT}
    for name, style in styles.items():
        holder = name.rpartition(".")[0]
        if style in ("colwise", "colwise_gather_output") and name.startswith(f"{list_name}."):
            # the holder is a block itself when the colwise layer sits directly in it: gather in the layer then
            block_level = holder.count(".") == list_name.count(".") + 1
            if style == "colwise":
                extra[name] = COLWISE_SEQ if block_level else "colwise"
            if not block_level:
                extra[holder] = GATHER
    for name, module in model.named_modules():
        inside = name.startswith(f"{list_name}.")
        after = name.rpartition(".")[0] == parent and not inside and name != list_name
        if is_norm(module) and (inside or after) and name not in styles:
            extra[name] = "sequence_parallel"
    styles = {**styles, **extra}
    _check_local_modules(model, list_name, styles)
    return styles


def _check_local_modules(model: nn.Module, list_name: str, styles: dict[str, str]) -> None:
    """Refuse a module with parameters that runs on this rank's tokens only and that no style covers.

    Inside the blocks, outside the modules that gather the tokens, a module runs on 1/tp of them: its gradient
    on each rank is that share's, and nothing would sum them (an MLP or MoE left out of an attention-only plan).
    """
    handled = [name for name, style in styles.items() if style != SPLIT]
    gathering = [name for name, style in styles.items() if style == GATHER]
    for name, module in model.named_modules():
        if not name.startswith(f"{list_name}.") or not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        if name in handled or any(name.startswith(f"{holder}.") for holder in gathering):
            continue
        raise ValueError(
            f"dist.tp.sequence_parallel=True: {name} (a {type(module).__name__} with parameters) sits inside the "
            "blocks but outside dist.tp.plan, so it would run on this rank's tokens only and each rank would keep "
            "only their share of its gradient; add it (or the layers of its module) to dist.tp.plan, or set "
            "dist.tp.sequence_parallel=False (every TP rank then runs it on all tokens, which is exact)"
        )


def gather_sequence(mesh: DeviceMesh):
    """A pre-hook that turns the module's hidden states (the first argument, or ``hidden_states=``) from this
    rank's tokens into a DTensor of all tokens (an all-gather; its backward reduce-scatters)."""

    def gather(x: torch.Tensor) -> DTensor:
        return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

    return hook


def check_sequence_length(length: int, *, size: int) -> None:
    """Raise unless ``size`` TP ranks can split a sequence of ``length`` tokens evenly (sequence parallelism).

    Raises:
        ValueError: naming the length and ``dist.tp.size``, and how to pad.
    """
    if length % size:
        raise ValueError(
            f"dist.tp.sequence_parallel=True splits each sequence over the dist.tp.size={size} ranks of a TP group, "
            f"but this batch has sequence length {length}, not a multiple of {size}; pad the batches to a multiple "
            f"of {size} (e.g. the tokenizer's or DataCollatorWithPadding's pad_to_multiple_of={size}), or set "
            "dist.tp.sequence_parallel=False"
        )


def sequence_check(size: int, *, tokens_only: bool):
    """A pre-hook checking the sequence length (dim 1) of the first argument, ``input_ids=``, ``inputs_embeds=``
    or ``hidden_states=``; with ``tokens_only``, only of token ids (integer tensors of two dims)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        candidates = [kwargs.get(key) for key in ("input_ids", "inputs_embeds", "hidden_states")]
        x = next((c for c in (*args[:1], *candidates) if isinstance(c, torch.Tensor)), None)
        if x is None or x.dim() < 2 or (tokens_only and (x.is_floating_point() or x.dim() != 2)):
            return
        if tokens_only or not isinstance(x, DTensor):
            check_sequence_length(x.shape[1], size=size)

    return hook


def install_sequence_check(model: nn.Module, *, size: int) -> None:
    """Check the sequence length of every batch on entry to ``model``, before anything communicates.

    Call it after the model is wrapped: the hook goes in front of FSDP's. It reads token ids
    (``input_ids``, or an integer first argument of shape (batch, sequence)); the first block checks its
    hidden states again (see ``apply_tp``), for models called otherwise.
    """
    model.register_forward_pre_hook(sequence_check(size, tokens_only=True), prepend=True, with_kwargs=True)
