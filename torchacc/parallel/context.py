"""Context parallelism on a Hugging Face model: apply it (``context_plan.py`` checks it first).

``resolve_context_parallel`` (context_plan.py) runs before any collective and raises the same ``ValueError`` on
every rank; ``apply_context_parallel`` runs in the engine after TP and before activation checkpointing and
``fully_shard``.
The loader cuts every sequence into this rank's chunk (``torchacc/data/context.py``); this module makes the
model train on the chunks exactly as on the whole sequences, without the user touching the model:

[Note: context parallelism on a transformers model]
* Attention. The model's attention implementation (``config._attn_implementation``, "sdpa" or "eager") is
  replaced by one registered in transformers' ``AttentionInterface`` ("torchacc_ulysses" or "torchacc_ring",
  ``context_attention.py``) that wraps it with the exchange between the ranks. The model's own mask builder
  has no entry for these names, so it hands the attention no mask; the wrapper uses the mask that the model
  would build for the whole sequences (padding, packed sequences), built from the positions and padding mask
  of all chunks: the sliding-window mask for the layers that ``config.layer_types`` (or, without it,
  ``config.sliding_window``) makes slide, as the model's decoder chooses, the causal mask for the others.
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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..data.context import IGNORE_INDEX, split_sequences
from .context_attention import CONTEXT_KWARG, ContextForward, ring_attention, ulysses_attention
from .context_plan import CPPlan
from .layout import Layout

__all__ = ["apply_context_parallel", "sequence_split"]

METHODS = {"ulysses": ("torchacc_ulysses", ulysses_attention), "ring": ("torchacc_ring", ring_attention)}


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
            sliding_layers=self.plan.sliding_layers,
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
