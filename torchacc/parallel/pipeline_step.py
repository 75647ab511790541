"""Pipeline parallelism, the step: ``train_step`` runs forward and backward through the schedule; evaluation.

[Note: one training loop] A pipeline cannot run ``loss = model(**batch).loss; loss.backward()``: the loss
exists only on the last stage, and the stages must interleave the forwards and backwards of their
microbatches. ``torchacc.train_step(model, batch)`` is that line for every layout: without a pipeline it is the
plain forward and backward; with one it runs the schedule (``torch.distributed.pipelining``: GPipe, 1F1B,
Interleaved 1F1B) over ``dist.pp.microbatches`` microbatches. Either way the gradients of the batch's loss are
accumulated into ``.grad`` (so gradient accumulation over several calls and clipping work as without a
pipeline), and the returned loss is the batch's, on every rank: the last stage computes it and sends it to the
other stages of its pipeline.

[Note: pipeline loss] The microbatch losses are sums over their tokens divided by the number of target tokens of
the whole batch (Hugging Face's ``num_items_in_batch``), and they add up: the loss and the gradients equal those
of ``model(**batch).loss`` on the whole batch, however the batch is cut, even with padding (``-100`` labels).

Evaluation: a pipelined model's ``model(**batch)`` (under ``model.eval()`` or ``torch.no_grad()``) runs the whole
batch through the stages in order and returns a ``CausalLMOutputWithPast`` whose ``loss`` (when ``labels`` are
given) is on every rank of the pipeline and whose ``logits`` are on the last stage's ranks only (None elsewhere).
"""

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from .layout import PipelineSchedule
from .pipeline_stages import StageModule

__all__ = ["PipelineRuntime", "attach_pipeline", "is_pipelined", "pipeline_group", "pipeline_runtime", "train_step"]

_RUNTIMES: "weakref.WeakKeyDictionary[nn.Module, PipelineRuntime]" = weakref.WeakKeyDictionary()
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_SCHEDULES = 4  # schedules kept, one per batch shape: see [Note: a schedule per batch shape]
_NO_PIPELINE_KWARGS = ("use_cache", "return_dict", "logits_to_keep", "output_hidden_states", "output_attentions")


class PipelineRuntime:
    """The stages this rank runs, their schedule, and the pipeline's process group (one per pipelined model)."""

    def __init__(
        self,
        model: nn.Module,
        stage_modules: list[StageModule],
        *,
        schedule: PipelineSchedule,
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self._model = weakref.ref(model)
        self.stage_modules = stage_modules
        self.group, self.device = group, device
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_stages, self.microbatches = schedule.num_stages, schedule.microbatches
        self._kind = schedule.schedule
        # [Note: a schedule per batch shape] torch's stages learn the shapes they send and receive from their
        # first step and keep them: a batch of another shape (the smaller last batch of a DataLoader, another
        # padded length) gets a schedule of its own, built on every rank of the pipeline at the same step (they
        # all see the batch's shape). The last few are kept, so that alternating shapes do not rebuild each time.
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        self.has_first = stage_modules[0].is_first
        self.has_last = stage_modules[-1].is_last
        self.last_rank = (schedule.num_stages - 1) % self.size  # the group rank of the last stage
        self._num_items: torch.Tensor | None = None
        self._scale: float = 1.0
        self._losses: list[torch.Tensor] = []
        self._step_hooks: OrderedDict[int, Callable[[torch.Tensor], None]] = OrderedDict()

    def schedule_of(self, batch: Mapping[str, Any]) -> Any:
        """The schedule that runs batches of ``batch``'s shapes (see [Note: a schedule per batch shape])."""
        shapes = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items()) if isinstance(v, torch.Tensor))
        if shapes in self._schedules:
            self._schedules.move_to_end(shapes)
            return self._schedules[shapes]
        # Imported here: torch.distributed.pipelining imports dynamo, about 1 s of CPU in every process otherwise.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        stages = [PipelineStage(m, m.index, self.num_stages, self.device, group=self.group) for m in self.stage_modules]
        kwargs = {"loss_fn": self._loss, "scale_grads": False}  # see [Note: pipeline loss]: the losses add up
        if self._kind == "Interleaved1F1B":
            schedule: Any = ScheduleInterleaved1F1B(stages, self.microbatches, **kwargs)
        else:
            cls = Schedule1F1B if self._kind == "1F1B" else ScheduleGPipe
            schedule = cls(stages[0], self.microbatches, **kwargs)
        self._schedules[shapes] = schedule
        if len(self._schedules) > _MAX_SCHEDULES:
            self._schedules.popitem(last=False)
        return schedule

    def register_step_hook(self, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """Call ``hook(loss)`` after each ``step`` (each ``train_step``) with the batch's loss, as ``step`` returns
        it (a device tensor, not read); the metrics take the training loss from here. ``handle.remove()`` ends it."""
        handle = RemovableHandle(self._step_hooks)
        self._step_hooks[handle.id] = hook
        return handle

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the pipelined model no longer exists")
        return model

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        model = self.model
        vocab = model.config.vocab_size
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=vocab, num_items_in_batch=self._num_items)
        self._losses.append(loss.detach())
        return loss * self._scale if self._scale != 1.0 else loss

    def _split_batch(self, batch: Any, *, training: bool) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        what = "torchacc.train_step(model, batch)" if training else "model(**batch)"
        if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
            got = sorted(map(str, batch)) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(
                f"{what} on a pipelined model (dist.pp.size > 1) takes a causal-LM batch: a dict with 'input_ids' (and "
                f"'labels' to train), got {got}"
            )
        kwargs = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", *_NO_PIPELINE_KWARGS)}
        labels = batch.get("labels")
        if training and labels is None:
            raise ValueError(f"{what} on a pipelined model needs batch['labels']: the last stage computes the loss")
        size = batch["input_ids"].shape[0]
        if training and size % self.microbatches:
            raise ValueError(
                f"{what}: the batch of {size} samples does not divide into dist.pp.microbatches={self.microbatches}; "
                "choose a batch size that is a multiple of it (or another number of microbatches)"
            )
        return batch["input_ids"], labels, kwargs

    def step(self, batch: Any, *, scale: float = 1.0) -> torch.Tensor:
        """One forward and backward of ``batch`` through the schedule; returns the loss (every rank)."""
        input_ids, labels, kwargs = self._split_batch(batch, training=True)
        self._num_items = (labels[..., 1:] != -100).sum()  # the targets of the whole batch: [Note: pipeline loss]
        self._scale, self._losses = scale, []
        args = (input_ids,) if self.has_first else ()
        self.schedule_of(batch).step(*args, target=labels if self.has_last else None, **kwargs)
        # the first step also runs the stages once to learn the shapes: the last losses are this batch's
        loss = torch.stack(self._losses[-self.microbatches :]).sum() if self.has_last else None
        self._losses = []
        loss = self._share(loss)
        for hook in list(self._step_hooks.values()):
            hook(loss)
        return loss

    def _share(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss on every rank of the pipeline."""
        value = torch.zeros((), dtype=torch.float32, device=self.device) if loss is None else loss.float().clone()
        dist.broadcast(value, group=self.group, group_src=self.last_rank)
        return value

    def evaluate(self, batch: Mapping[str, Any]) -> Any:
        """The whole batch through the stages in order, without gradients (see the module docstring)."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        model = self.model
        if model.training and torch.is_grad_enabled():
            raise RuntimeError(
                "a pipelined model (dist.pp.size > 1) cannot run a training forward on its own: the stages must "
                "interleave forwards and backwards. Train with `loss = torchacc.train_step(model, batch)`; to "
                "evaluate, call model.eval() (or run under torch.no_grad()) first"
            )
        input_ids, labels, kwargs = self._split_batch(batch, training=False)
        hidden = input_ids
        with torch.no_grad():
            for module in self.stage_modules:
                if not module.is_first:
                    hidden = self._recv((module.index - 1) % self.size)
                hidden = module(hidden, **kwargs)
                if not module.is_last:
                    self._send(hidden, (module.index + 1) % self.size)
            loss = None
            if self.has_last and labels is not None:
                loss = model.loss_function(logits=hidden, labels=labels, vocab_size=model.config.vocab_size)
        for module in self.stage_modules:  # no backward will reshard them: free the gathered parameters now
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()
        if labels is not None:
            loss = self._share(loss)
        return CausalLMOutputWithPast(loss=loss, logits=hidden if self.has_last else None)

    def _send(self, tensor: torch.Tensor, peer: int) -> None:
        tensor = tensor.contiguous()
        header = torch.zeros(10, dtype=torch.int64, device=tensor.device)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(header, group=self.group, group_dst=peer)
        dist.send(tensor, group=self.group, group_dst=peer)

    def _recv(self, peer: int) -> torch.Tensor:
        header = torch.zeros(10, dtype=torch.int64, device=self.device)
        dist.recv(header, group=self.group, group_src=peer)
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        tensor = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=self.device)
        dist.recv(tensor, group=self.group, group_src=peer)
        return tensor


class _PipelinedForward:
    """``model(**batch)`` of a pipelined model: evaluation through the stages."""

    def __init__(self, runtime: PipelineRuntime) -> None:
        self.runtime = runtime

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) > 1 or (args and "input_ids" in kwargs):
            raise ValueError("call a pipelined model as model(input_ids, ...) or with keyword arguments only")
        return self.runtime.evaluate({"input_ids": args[0], **kwargs} if args else kwargs)


def attach_pipeline(
    model: nn.Module,
    stage_modules: list[StageModule],
    *,
    schedule: PipelineSchedule,
    group: dist.ProcessGroup,
    device: torch.device,
) -> PipelineRuntime:
    """Build the stages' schedule and make ``model(...)`` evaluate through the pipeline (the engine calls it)."""
    runtime = PipelineRuntime(model, stage_modules, schedule=schedule, group=group, device=device)
    _RUNTIMES[model] = runtime
    model.forward = _PipelinedForward(runtime)
    return runtime


def pipeline_runtime(model: nn.Module) -> PipelineRuntime | None:
    """The stages, schedule and group of a pipelined model (the planner traces them), or None."""
    return _RUNTIMES.get(model)


def is_pipelined(model: nn.Module) -> bool:
    """Whether ``model`` runs as a pipeline (``dist.pp.size > 1``): train it with ``train_step``."""
    return model in _RUNTIMES


def pipeline_group(parameters: Iterable[torch.Tensor]) -> dist.ProcessGroup | None:
    """The pipeline group of the pipelined model these parameters belong to, or None."""
    ids = {id(p) for p in parameters}
    for model, runtime in list(_RUNTIMES.items()):
        if any(id(p) in ids for p in model.parameters()):
            return runtime.group
    return None


def train_step(model: nn.Module, batch: Any, *, scale: float = 1.0) -> torch.Tensor:
    """Forward and backward of one batch, for every layout: the one line a training loop changes.

    Without a pipeline it is ``loss = model(**batch).loss; (loss * scale).backward()``; with ``dist.pp.size > 1``
    it runs the pipeline schedule over the batch's microbatches (see [Note: one training loop]). Gradients
    accumulate into ``.grad`` as ``backward()`` does; step and zero the optimizer as usual.

    Args:
        model: the model returned by ``torchacc.accelerate()`` (or any model whose output has ``.loss``).
        batch: a dict of tensors (``input_ids`` and ``labels`` for a pipeline), or one tensor (no pipeline).
        scale: multiplies the loss before backward, e.g. ``1 / accumulation_steps``; the returned loss is unscaled.

    Returns:
        The batch's loss, detached, in float32; with a pipeline the same value on every rank of the pipeline.

    Raises:
        ValueError: an output without ``.loss``; with a pipeline, a batch without ``input_ids`` or ``labels``, or
            whose size ``dist.pp.microbatches`` does not divide (the same on every rank, before any collective).

    Example:
        >>> for batch in loader:
        ...     loss = torchacc.train_step(model, batch)  # in place of: loss = model(**batch).loss; loss.backward()
        ...     optimizer.step(); optimizer.zero_grad()
    """
    runtime = _RUNTIMES.get(model)
    if runtime is not None:
        return runtime.step(batch, scale=scale)
    output = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise ValueError(
            f"torchacc.train_step: the output of {type(model).__name__} has no .loss; pass labels in the batch, or "
            "compute the loss yourself and call loss.backward()"
        )
    del output  # its logits (batch x seq x vocab), the step's largest tensor, are not needed by the backward
    (loss * scale if scale != 1.0 else loss).backward()
    return loss.detach().float()
