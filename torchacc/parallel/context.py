"""Context parallelism on a Hugging Face model: check it (``resolve_context_parallel``), then apply it.

``resolve_context_parallel`` runs before any collective and raises the same ``ValueError`` on every rank;
``apply_context_parallel`` runs in the engine after TP and before activation checkpointing and ``fully_shard``.
The loader cuts every sequence into this rank's chunk (``torchacc/data/context.py``); this module makes the
model train on the chunks exactly as on the whole sequences, without the user touching the model:

[Note: context parallelism on a transformers model]
* Attention. The model's attention implementation (``config._attn_implementation``, "sdpa" or "eager") is
  replaced by one registered in transformers' ``AttentionInterface`` ("torchacc_ulysses" or "torchacc_ring",
  ``context_attention.py``) that wraps it with the exchange between the ranks. The model's own mask builder
  has no entry for these names, so it hands the attention no mask; the wrapper uses the mask that the model
  would build for the whole sequences (padding, packed sequences), built from the positions and padding mask
  of all chunks.
* One forward. A pre-forward hook gathers the chunks' positions, padding masks and target counts from the
  ranks of the CP group (one all-gather of small integer tensors), and passes a ``ContextForward`` down to the
  attention layers in the ``torchacc_cp`` keyword argument, which transformers forwards to them. It also turns
  the KV cache off (``use_cache=False``): generation is not supported, and a cache would make an
  activation-checkpointed layer's recomputation see its chunk's keys twice.
* The loss. With ``labels``, the hook asks the model for the sum of its chunk's token losses
  (``num_items_in_batch=1``). After the forward, the sums of the CP group are added up (one all-reduce of a
  scalar) and divided by the group's number of targets: every rank of the group returns the loss of the whole
  sequences, the one-process value. Its gradient is ``cp`` times this rank's share, because ``fully_shard``
  averages the gradients over ``fsdp x cp`` ranks while the shares of one sequence must add up.
"""

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..data.context import IGNORE_INDEX, split_sequences
from .context_attention import CONTEXT_KWARG, ContextForward, ring_attention, ulysses_attention
from .layout import Layout

__all__ = ["CPPlan", "apply_context_parallel", "resolve_context_parallel", "sequence_split"]

METHODS = {"ulysses": ("torchacc_ulysses", ulysses_attention), "ring": ("torchacc_ring", ring_attention)}
SUPPORTED_ATTENTION = {"ulysses": ("sdpa", "eager"), "ring": ("sdpa",)}


@dataclass(frozen=True)
class CPPlan:
    """A checked context-parallel plan for one model."""

    size: int
    method: str
    attn_implementation: str
    """The model's own attention implementation, which runs on the whole sequences."""


def sequence_split(layout: Layout, rank: int) -> Callable[[Any], dict[str, Any]] | None:
    """The loader's batch transform for global rank ``rank``: its chunk of every sequence (None without CP)."""
    if layout.dims.cp == 1:
        return None
    return functools.partial(
        split_sequences,
        rank=layout.dims.context_parallel_rank(rank),
        size=layout.dims.cp,
        head_tail=layout.cp_method == "ring",
    )


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal") and hasattr(m, "config")
    ]


def resolve_context_parallel(model: nn.Module, *, size: int, method: str, tp_size: int = 1) -> CPPlan:
    """Check that ``model``'s attention can run over sequences split into ``size`` chunks; no communication.

    Args:
        model: the plain model: a transformers model whose attention goes through ``AttentionInterface``.
        size: ``dist.cp.size``.
        method: ``dist.cp.method``, "ulysses" or "ring".
        tp_size: ``dist.tp.size``: with TP each rank holds ``1 / tp_size`` of the heads, which CP then shares.

    Returns:
        The plan ``apply_context_parallel`` carries out.

    Raises:
        ValueError: a model without such attention (no Hugging Face config, or attention modules that do not
            go through the interface), non-causal, sliding-window or chunked attention, an attention
            implementation other than sdpa or eager (sdpa for "ring"), or heads that ``tp_size * size`` does not
            divide.
    """
    hf_config = getattr(model, "config", None)
    implementation = getattr(hf_config, "_attn_implementation", None)
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    attention = _attention_modules(model)
    if implementation is None or not attention or (callable(can_set) and not can_set()):
        raise ValueError(
            f"dist.cp.size={size} runs the attention of a Hugging Face transformers model over split sequences, but "
            f"torchacc finds no such attention in {type(model).__name__}: it needs a transformers model (a "
            "model.config with _attn_implementation) whose attention layers call transformers' AttentionInterface "
            "(Llama, Qwen2, Mistral and most decoders do); train this model without context parallelism "
            "(dist.cp.size=1)"
        )
    name = type(model).__name__
    bidirectional = [n for n, m in attention if not m.is_causal]
    if bidirectional:
        raise ValueError(
            f"dist.cp splits causal (decoder) attention, but {name}.{bidirectional[0]} attends both ways "
            "(is_causal=False); train this model without context parallelism (dist.cp.size=1)"
        )
    if not getattr(model, "supports_context_parallel", True):
        raise ValueError(
            f"dist.cp: {name} has sliding-window or chunked attention layers (config.layer_types or "
            "config.sliding_window), whose masks torchacc does not build over split sequences; use a config "
            "without them (e.g. use_sliding_window=False) or dist.cp.size=1"
        )
    supported = SUPPORTED_ATTENTION[method]
    if implementation not in supported:
        raise ValueError(
            f"dist.cp.method={method!r} runs the model's attention over whole sequences as "
            f"{' or '.join(supported)}, but {name} uses attn_implementation={implementation!r}; load it with "
            f"from_pretrained(..., attn_implementation='sdpa') or call model.set_attn_implementation('sdpa')"
        )
    split = size * tp_size
    for field_name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(hf_config, field_name, None)
        if isinstance(heads, int) and heads % split:
            what = f"dist.cp.size={size}" + (f" * dist.tp.size={tp_size} = {split}" if tp_size > 1 else "")
            choices = [n for n in range(1, heads + 1) if heads % (n * tp_size) == 0]
            raise ValueError(
                f"{what} does not divide {field_name}={heads} of {type(hf_config).__name__}: the ranks of a CP group "
                f"each attend with a share of the heads; choose dist.cp.size in {choices}"
            )
    return CPPlan(size=size, method=method, attn_implementation=implementation)


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, plan: CPPlan) -> None:
    """Make ``model`` train on this rank's chunks as on whole sequences; see the note at the top of this module.

    Every rank of ``mesh`` (the 1-D ``cp`` mesh) must call it. The model's ``config._attn_implementation``
    names torchacc's attention afterwards; nothing else of the model changes.
    """
    from transformers import AttentionInterface

    name, function = METHODS[plan.method]
    AttentionInterface.register(name, function)
    mask_config = copy.copy(model.config)
    mask_config._attn_implementation_internal = plan.attn_implementation
    model.set_attn_implementation(name)
    if plan.method == "ring":
        from torch.distributed.tensor.experimental._attention import (
            _cp_options,
            _enable_context_parallel_dispatcher,
        )

        _cp_options.enable_load_balance = True  # the loader deals the chunks head-tail
        _enable_context_parallel_dispatcher()
    hooks = _ForwardHooks(mesh, plan, mask_config)
    model.register_forward_pre_hook(hooks.before, with_kwargs=True)
    model.register_forward_hook(hooks.after, with_kwargs=True)


class _ForwardHooks:
    """The pre- and post-forward hooks of [Note: context parallelism on a transformers model]."""

    def __init__(self, mesh: DeviceMesh, plan: CPPlan, mask_config: Any) -> None:
        self.mesh, self.plan, self.mask_config = mesh, plan, mask_config
        self.head_tail = plan.method == "ring"

    def _local_positions(self, num_batch: int, length: int, device: torch.device) -> torch.Tensor:
        """The positions of this rank's chunk when the batch brings none (what ``split_sequences`` adds)."""
        size, rank = self.plan.size, self.mesh.get_local_rank()
        positions = torch.arange(length * size, device=device).view(1, -1)
        pieces = positions.chunk(2 * size if self.head_tail else size, dim=1)
        mine = torch.cat([pieces[rank], pieces[2 * size - 1 - rank]], dim=1) if self.head_tail else pieces[rank]
        return mine.expand(num_batch, length)

    def _gather(self, chunks: torch.Tensor) -> torch.Tensor:
        """``(k, batch, chunk)`` from every rank -> ``(k, batch, seq)`` in sequence order."""
        size = self.plan.size
        parts = [torch.empty_like(chunks) for _ in range(size)]
        dist.all_gather(parts, chunks.contiguous(), group=self.mesh.get_group())
        if not self.head_tail:
            return torch.cat(parts, dim=2)
        halves = [p.chunk(2, dim=2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=2)

    def before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if tokens is None:
            raise ValueError("dist.cp: call the model with input_ids (or inputs_embeds): model(**batch)")
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(
                "dist.cp splits sequences for training and evaluation; generation (a KV cache) is not supported "
                "under dist.cp: generate with a model accelerated without context parallelism"
            )
        labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
        if labels is not None and shift_labels is None:
            raise ValueError(
                "dist.cp: the model got labels without shift_labels; each rank holds a chunk of every sequence, and "
                "shifting a chunk's labels loses the target of its last token: pass the batch as the loader gives "
                "it, model(**batch) (it holds shift_labels, shifted before the split)"
            )
        num_batch, length = tokens.shape[:2]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = kwargs["position_ids"] = self._local_positions(num_batch, length, tokens.device)
        mask = kwargs.get("attention_mask")
        targets = shift_labels
        if targets is None:
            targets = torch.full((num_batch, length), IGNORE_INDEX, device=tokens.device)
        ignore = kwargs.get("ignore_index", IGNORE_INDEX)
        local = torch.stack(
            [
                positions.expand(num_batch, length).long(),
                torch.ones_like(targets, dtype=torch.long) if mask is None else mask.long(),
                (targets != ignore).long(),
            ]
        )
        full_positions, full_mask, valid = self._gather(local)
        if self.head_tail and (not bool(full_mask.all()) or not _counts_up(full_positions)):
            raise ValueError(
                "dist.cp.method='ring' runs plain causal attention over whole sequences: the batch's attention_mask "
                "has padding or its position_ids restart (packed sequences); use dist.cp.method='ulysses', which "
                "builds the model's own mask"
            )
        context = ContextForward(
            mesh=self.mesh,
            attn_implementation=self.plan.attn_implementation,
            mask_config=self.mask_config,
            position_ids=full_positions,
            attention_mask=full_mask.bool() if mask is not None else None,
        )
        kwargs[CONTEXT_KWARG] = context
        # A KV cache would hold this chunk's keys, and a recomputing (activation-checkpointed) layer would append
        # its keys to them a second time: the all-to-all would then mix up chunks.
        kwargs["use_cache"] = False
        if labels is not None and kwargs.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = 1  # the model returns the sum of its chunk's token losses
            context.num_targets = valid.sum()
        return args, kwargs

    def after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        context = kwargs[CONTEXT_KWARG]
        if context.num_calls == 0:
            raise RuntimeError(
                f"dist.cp: no attention layer of {type(module).__name__} ran through torchacc's attention "
                f"(config._attn_implementation={module.config._attn_implementation!r}), so each rank attended only "
                "within its own chunk; this model does not dispatch its attention through transformers' "
                "AttentionInterface: train it with dist.cp.size=1"
            )
        loss = output[0] if isinstance(output, tuple) else getattr(output, "loss", None)
        if kwargs.get("labels") is None or loss is None:
            return output
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.mesh.get_group())
        scaled = loss * self.plan.size  # see the note: fully_shard averages over the CP ranks too
        combined = scaled + (total - scaled).detach()
        if context.num_targets is not None:
            combined = combined / context.num_targets
        if isinstance(output, tuple):
            return (combined, *output[1:])
        output["loss"] = combined
        return output


def _counts_up(positions: torch.Tensor) -> bool:
    """True when every row of ``positions`` is ``0, 1, 2, ...`` (no packed sequences)."""
    return torch.equal(positions, torch.arange(positions.shape[1], device=positions.device).expand_as(positions))
