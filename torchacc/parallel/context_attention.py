"""Attention over a sequence split among the ranks of a CP group: Ulysses all-to-alls or torch's ring attention.

Both functions have the signature of transformers' attention functions (``AttentionInterface``): the model's
attention module projects this rank's chunk of tokens to queries, keys and values (rotary embeddings already
applied at the chunk's true positions) and calls the function registered under ``config._attn_implementation``.
What the function needs beyond that arrives in the ``torchacc_cp`` keyword argument, one ``ContextForward`` per
forward, which transformers passes down from the model's call to every attention layer (``context.py`` adds it).

[Note: Ulysses attention] (DeepSpeed-Ulysses) One all-to-all turns the chunk of every head, shaped
``(batch, heads, chunk, dim)``, into the whole sequence of ``heads / cp`` heads: each rank sends the i-th share
of its heads to rank i and receives every rank's chunk for its own share. The model's own attention (sdpa or
eager) then runs on whole sequences, with the mask transformers builds for the whole sequence, and a second
all-to-all turns the output back into this rank's chunk of every head. Grouped key/value heads are shared
the same way (head ``h`` of share ``i`` uses key/value head ``h // group``, which lies in share ``i`` too).
Each all-to-all moves ``(cp - 1) / cp`` of the tensor it is given, in both directions again in backward.
"""

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ContextForward", "ring_attention", "ulysses_attention"]

CONTEXT_KWARG = "torchacc_cp"
"""The keyword argument that carries the ``ContextForward`` from the model's call to its attention layers."""


class ContextForward:
    """What the attention layers of one forward need to see the whole sequence (built by ``context.py``).

    A plain class, not a dataclass: FSDP's input casting rebuilds dataclasses (``dataclasses.replace``) on
    their way into every unit, and each layer would count its calls on a copy.

    Attributes:
        mesh: the 1-D ``cp`` mesh.
        attn_implementation: the model's own attention ("sdpa" or "eager"), run on whole sequences.
        mask_config: a copy of the model's config naming ``attn_implementation``, for transformers' mask builder.
        position_ids: positions of the whole sequences, ``(batch, seq)``.
        attention_mask: the whole sequences' 2-D padding mask, or None (no padding).
        sliding_layers: the ``layer_idx`` of the layers that attend with a sliding window.
        num_targets: the number of targets of the whole sequences when the loss is the sum of each chunk's.
        num_calls: attention layers run so far (the model checks after its forward that some did).
    """

    __slots__ = ("mesh", "attn_implementation", "mask_config", "position_ids", "attention_mask", "num_targets")
    __slots__ += ("sliding_layers", "num_calls", "_masks")

    def __init__(
        self,
        *,
        mesh: DeviceMesh,
        attn_implementation: str,
        mask_config: Any,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        sliding_layers: frozenset[int] = frozenset(),
    ) -> None:
        self.mesh = mesh
        self.attn_implementation = attn_implementation
        self.mask_config = mask_config
        self.position_ids = position_ids
        self.attention_mask = attention_mask
        self.sliding_layers = sliding_layers
        self.num_targets: torch.Tensor | None = None
        self.num_calls = 0
        self._masks: dict[tuple[torch.dtype, bool], Any] = {}

    def full_mask(self, dtype: torch.dtype, *, layer_idx: int | None = None) -> Any:
        """The mask the model itself would build for the whole sequences for layer ``layer_idx`` (the sliding-window
        mask for a sliding layer, else the causal one; None: plain causal), built once per kind."""
        sliding = layer_idx in self.sliding_layers
        if (dtype, sliding) not in self._masks:
            from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

            num_batch, length = self.position_ids.shape
            shape_only = torch.empty(num_batch, length, 0, dtype=dtype, device=self.position_ids.device)
            build = create_sliding_window_causal_mask if sliding else create_causal_mask
            self._masks[dtype, sliding] = build(
                config=self.mask_config,
                inputs_embeds=shape_only,
                attention_mask=self.attention_mask,
                cache=None,
                position_ids=self.position_ids,
            )
        return self._masks[dtype, sliding]


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` over equal splits of dim 0; its backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tensor = tensor.contiguous()  # dim 0 splits must be contiguous blocks, in the input and the output alike
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    return out


def _chunks_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """``(batch, heads, chunk, dim)`` of this rank's chunk -> ``(batch, heads / size, seq, dim)`` of its heads."""
    b, h, n, d = x.shape
    parts = x.reshape(b, size, h // size, n, d).transpose(0, 1)  # part i: the heads that rank i takes
    got = _AllToAll.apply(parts, group)  # got[j]: rank j's chunk of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * n, d)


def _heads_to_chunks(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """``(batch, seq, heads / size, dim)`` of this rank's heads -> ``(batch, chunk, heads, dim)`` of its chunk."""
    b, s, h, d = x.shape
    parts = x.reshape(b, size, s // size, h, d).transpose(0, 1)  # part i: rank i's chunk
    got = _AllToAll.apply(parts, group)  # got[j]: this rank's chunk of rank j's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * h, d)


def _take_context(kwargs: dict[str, Any]) -> ContextForward:
    context = kwargs.pop(CONTEXT_KWARG, None)
    if context is None:
        raise RuntimeError(
            "dist.cp: an attention layer ran without the sequence-split context: call the accelerated model itself "
            "(model(**batch)), not one of its submodules, and make sure the model passes its keyword arguments down "
            "to its attention layers (transformers models that support the attention interface do)"
        )
    context.num_calls += 1
    return context


def _own_attention(module: torch.nn.Module, name: str) -> Callable[..., Any]:
    """The function transformers would call for ``name``: a registered one, or the model file's eager one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract over a split sequence; see [Note: Ulysses attention].

    ``attention_mask`` (what the model built for its chunk) is ignored: the whole sequence's mask comes from the
    context. Returns ``(output of shape (batch, chunk, heads, dim), None)``: no attention weights.
    """
    context = _take_context(kwargs)
    kwargs.pop("position_ids", None)  # this chunk's; the mask already holds what positions say about packing
    group, size = context.mesh.get_group(), context.mesh.size()
    q, k, v = (_chunks_to_heads(t, group, size) for t in (query, key, value))
    attend = _own_attention(module, context.attn_implementation)
    out, _ = attend(module, q, k, v, context.full_mask(q.dtype, layer_idx=getattr(module, "layer_idx", None)), **kwargs)
    return _heads_to_chunks(out, group, size), None


def ring_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract through torch's ring attention (CUDA; causal, no padding).

    The chunks follow torch's head-tail layout (``split_sequences(head_tail=True)``): the queries, keys and
    values become DTensors sharded on the sequence, and torch's context-parallel dispatcher (enabled by
    ``context.py``) runs ``scaled_dot_product_attention`` on them as ring attention, forward and backward.
    """
    from torch.distributed.tensor import DTensor, Shard
    from transformers.integrations.sdpa_attention import repeat_kv

    context = _take_context(kwargs)
    groups = query.shape[1] // key.shape[1]
    tensors = (query, repeat_kv(key, groups), repeat_kv(value, groups))
    q, k, v = (DTensor.from_local(t.contiguous(), context.mesh, [Shard(2)], run_check=False) for t in tensors)
    dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, dropout_p=dropout, scale=kwargs.get("scaling")
    )
    return out.to_local().transpose(1, 2).contiguous(), None
