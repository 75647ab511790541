"""Keep buffers (BatchNorm's running statistics, step counters) equal on every rank under FSDP.

FSDP2 shards parameters only: each rank keeps its own copy of every buffer, and a forward that updates
one (BatchNorm in training mode) updates it with this rank's batch only, so the copies drift apart and a
checkpoint keeps only one rank's. DDP broadcasts all buffers from rank 0 before each forward
(``broadcast_buffers=True``). ``broadcast_changed_buffers`` does the same for the buffers that a forward
changes: before each forward of the root, as DDP does (after it, the backward may still need them
unchanged), so every forward, evaluation included, starts from rank 0's values. Which buffers a forward
changes is learnt from the first forward in training mode and the first in eval mode: a copy taken
before it is compared with the buffers after it, and the ranks agree on the result in one all-reduce.
A model whose forward changes no buffer (most transformers) then communicates nothing more. (A buffer's
version counter cannot tell: ``batch_norm`` updates the running statistics without moving it.)
"""

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.collectives import broadcast_tensors

__all__ = ["broadcast_changed_buffers"]


class _BufferSync:
    def __init__(self, model: nn.Module, src: int) -> None:
        self.buffers = [b for _, b in model.named_buffers()]
        self.src = src
        self.changing: dict[bool, list[torch.Tensor]] = {}  # training mode -> the buffers its forward changes
        self.before: list[torch.Tensor] | None = None

    def before_forward(self, module: nn.Module, *_: Any) -> None:
        known = {id(b): b for buffers in self.changing.values() for b in buffers}
        if known:
            broadcast_tensors(list(known.values()), src=self.src)
        if module.training not in self.changing:
            self.before = [b.detach().clone() for b in self.buffers]

    def after_forward(self, module: nn.Module, *_: Any) -> None:
        if module.training not in self.changing and self.before is not None:
            changed = torch.tensor([not torch.equal(b, old) for b, old in zip(self.buffers, self.before, strict=True)])
            dist.all_reduce(changed, op=dist.ReduceOp.MAX)  # a CPU tensor: gloo, also in a CUDA job
            self.changing[module.training] = [b for b, flag in zip(self.buffers, changed.tolist(), strict=True) if flag]
            self.before = None


def broadcast_changed_buffers(model: nn.Module, *, src: int = 0) -> None:
    """Broadcast from rank ``src``, before each forward, the buffers of ``model`` that its forward changes.

    Every rank must install it on the same model, before the first forward; nothing happens for a model
    without buffers or outside a process group of several ranks.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    sync = _BufferSync(model, src)
    if not sync.buffers:
        return
    model.register_forward_pre_hook(sync.before_forward)
    model.register_forward_hook(sync.after_forward)
