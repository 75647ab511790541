"""Installing metrics on an accelerated model: the hooks that feed its ``Recorder``, and the public calls.

``install_metrics`` (called by ``accelerate()`` and ``FSDP2Strategy`` once the model is sharded) attaches:

* a forward hook on the root module that keeps the output's ``.loss`` (a tensor, not read) once a backward
  runs through it, and a forward pre-hook that starts the clock at the first forward. A pipelined model's
  forward only evaluates (the schedule calls its stages), so the clock starts at its stages' first forward and
  the loss is the one ``torchacc.train_step`` returns (``PipelineRuntime.register_step_hook``: the pipeline's
  loss, the same on every rank of the pipeline);
* the loader's observer (``ShardedDataLoader.observe``): tokens of each host batch and the wait for it;
* two process-wide optimizer hooks (``register_optimizer_step_pre_hook``/``post_hook``), registered once
  while any model is watched and removed with the last one: the first optimizer that steps the model's
  parameters marks its step boundaries. The pre-hook computes the gradient norm on steps to log, before the
  step and before ``zero_grad``; ``torchacc.clip_grad_norm_`` hands its own norm over instead. The step count
  starts from the optimizer's own (Adam's ``step`` state), so a run resumed from a checkpoint goes on counting.

With ``every=0`` nothing is attached (and a previous installation on the model is removed).
"""

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .._utils.internal_steps import in_internal_optimizer_step
from .._utils.logging import warn_once
from ..data import ShardedDataLoader
from ..distributed import env
from ..distributed.collectives import raise_on_any_rank
from ..parallel.accelerated import accelerated_state
from .counting import attention_shape, peak_flops_of
from .record import Recorder, _number, check_values
from .sinks import Sinks

__all__ = ["install_metrics", "watch_loader", "note_grad_norm", "log_metrics", "last_metrics", "close_metrics"]


@dataclass(eq=False)
class _Watch:
    """One watched model: its recorder, rank 0's sinks, the hooks on the model, the optimizer it follows."""

    recorder: Recorder
    sinks: Sinks | None
    handles: list[RemovableHandle]
    finalizer: Any = None
    optimizer: Any = None  # a weakref to the optimizer that steps the model's parameters
    foreign: "weakref.WeakSet[torch.optim.Optimizer]" = field(default_factory=weakref.WeakSet)

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        bound = self.optimizer() if self.optimizer is not None else None
        if bound is optimizer:
            return True
        if optimizer in self.foreign:
            return False
        ids = self.recorder.param_ids
        if any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
            if bound is None:
                self.optimizer = weakref.ref(optimizer)
                self.recorder.step = _steps_taken(optimizer)  # a resumed run goes on counting
                return True
            warn_once(
                "torchacc metrics follow the first optimizer that steps the model's parameters; the steps of "
                "another one are not counted"
            )
        self.foreign.add(optimizer)
        return False

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self.sinks is not None:
            self.sinks.close()


_live: dict[int, _Watch] = {}  # id(model) -> its watch, in installation order
_global_hooks: list[RemovableHandle] = []


def install_metrics(
    model: nn.Module,
    loader: ShardedDataLoader | None = None,
    *,
    every: int,
    sinks: set[str],
    dir: str,
    peak_flops: float | None,
    run_name: str | None,
) -> Recorder | None:
    """Record ``model``'s training every ``every`` optimizer steps (0: remove any recording). Every rank calls it.

    Args:
        model: an accelerated model (``torchacc.accelerated_state(model)`` describes it).
        loader: its loader from ``accelerate()``/``process_dataloader``, whose batches are counted, or None.
        every, sinks, dir, peak_flops, run_name: as ``config.metrics`` (validated).

    Returns:
        The model's ``Recorder``, or None when ``every`` is 0.

    Raises:
        RuntimeError: rank 0 could not open a sink (an unwritable ``dir``); raised on every rank.
    """
    _remove(id(model))
    if every == 0:
        if loader is not None:
            loader.observe(None)
        return None
    state = accelerated_state(model)
    params = list(model.parameters())
    dims, pipeline = state.layout.dims, state.pipeline
    shape = attention_shape(model)
    peak = peak_flops if peak_flops is not None else peak_flops_of(state.device)
    if peak is None and state.device.type == "cuda":
        warn_once(
            f"torchacc metrics leave mfu out: no peak FLOP/s is known for {torch.cuda.get_device_name(state.device)}; "
            "set metrics.peak_flops to one device's peak"
        )
    opened, error = None, None
    if env.rank() == 0:
        try:
            opened = Sinks(set(sinks), dir=dir, run_name=run_name or time.strftime("run-%Y%m%d-%H%M%S"))
        except Exception as exc:  # any failure to open a sink (a path, a W&B login) reaches every rank
            error = f"{type(exc).__name__}: {exc}; check metrics.dir={dir!r} and metrics.sinks"
    raise_on_any_rank(error, what="opening the metrics sinks")
    num_trainable = sum(p.numel() for p in params if p.requires_grad)  # a DTensor's numel is the whole tensor's
    if pipeline is not None:  # this rank holds its stages' parameters only (never one tied across stages)
        num_trainable = _sum_over(pipeline.group, num_trainable)
    recorder = Recorder(
        params,
        every=every,
        device=state.device,
        num_ranks_per_batch=dims.world_size // dims.num_data_ranks,  # see [Note: counting tokens] in counting.py
        flops_per_token=6.0 * num_trainable,
        attention_flops=12.0 * shape[0] * shape[1] if shape else 0.0,
        peak_flops=peak,
        write=opened.write if opened is not None else _drop,
    )
    if pipeline is None:
        handles = [
            model.register_forward_pre_hook(lambda *_: recorder.start()),
            model.register_forward_hook(_loss_hook(recorder)),
        ]
    else:  # the schedule calls the stages, not the model, whose forward only evaluates: the loss is train_step's
        handles = [stage.register_forward_pre_hook(lambda *_: recorder.start()) for stage in pipeline.stage_modules]
        handles.append(pipeline.register_step_hook(recorder.add_loss))
    watch = _Watch(recorder, opened, handles)
    watch.finalizer = weakref.finalize(model, _remove, id(model))
    _live[id(model)] = watch
    if not _global_hooks:
        _global_hooks.extend(
            (register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step))
        )
    if loader is not None:
        loader.observe(recorder)
    return recorder


def watch_loader(loader: ShardedDataLoader, model: nn.Module | None) -> None:
    """Count ``loader``'s batches for ``model``'s recorder, if it has one (the strategy builds them apart)."""
    watch = _live.get(id(model)) if model is not None else None
    loader.observe(watch.recorder if watch is not None else None)


def note_grad_norm(norm: float, params: list[torch.Tensor]) -> None:
    """Hand the norm ``torchacc.clip_grad_norm_`` computed to the recorder of the model owning ``params``."""
    if _live and params:
        first = id(params[0])
        for watch in _live.values():
            if first in watch.recorder.param_ids:
                watch.recorder.note_clip(norm)


def log_metrics(values: dict[str, Any], step: int | None = None) -> None:
    """Add your own values to the records (call it on every rank or on rank 0; rank 0's values are written).

    Args:
        values: names to numbers or one-element tensors, e.g. ``{"val_loss": val_loss}``; tensors are read
            only when written.
        step: None joins the values to the next record; an int writes them now, as a record of their own at that
            step (e.g. an evaluation after an epoch; W&B keeps only steps that increase).

    Raises:
        ValueError: a value that is not a number, or a name torchacc records itself (``loss``, ``step``, ...).

    Example:
        >>> torchacc.log_metrics({"val_loss": val_loss.item()})
    """
    values = check_values(values)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"log_metrics: step must be None or an int >= 0, got {step!r}")
    watch = next(reversed(_live.values()), None)
    if watch is None:
        warn_once("torchacc.log_metrics: metrics are off (metrics.every=0), so the values are dropped")
        return
    if step is None:
        watch.recorder.pending.update(values)
    elif watch.sinks is not None:
        watch.sinks.write({"step": step, **{key: _number(value) for key, value in values.items()}})


def last_metrics() -> dict[str, float]:
    """The last record of the most recently accelerated model with metrics on (a copy); {} before the first.

    Example:
        >>> print(torchacc.last_metrics().get("tokens_per_second"))
    """
    watch = next(reversed(_live.values()), None)
    return dict(watch.recorder.last) if watch is not None else {}


def close_metrics() -> None:
    """Stop recording every model, and flush and close the sinks (done at exit, or when a model is freed)."""
    for key in list(_live):
        _remove(key)


def _remove(key: int) -> None:
    watch = _live.pop(key, None)
    if watch is None:
        return
    watch.finalizer.detach()
    watch.close()
    if not _live:
        while _global_hooks:
            _global_hooks.pop().remove()


def _loss_hook(recorder: Recorder) -> Any:
    def keep_loss(module: nn.Module, args: Any, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:  # not under no_grad
            # Kept when a backward runs through it: an evaluation in eval mode with gradients enabled (no backward)
            # is no training loss.
            value = loss.detach()
            loss.register_hook(lambda grad: recorder.add_loss(value))

    return keep_loss


def _sum_over(group: Any, count: int) -> int:
    """``count`` summed over the ranks of ``group`` (a CPU tensor: gloo, also in a CUDA job)."""
    total = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(total, group=group)
    return int(total.item())


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if in_internal_optimizer_step():  # a checkpoint load creating the optimizer's state: not a training step
        return
    for watch in list(_live.values()):
        if watch.owns(optimizer):
            watch.recorder.before_step()


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if in_internal_optimizer_step():
        return
    for watch in list(_live.values()):
        if watch.owns(optimizer):
            groups = optimizer.param_groups
            watch.recorder.after_step(groups[0].get("lr") if groups else None)


def _steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """The steps an optimizer's loaded state has taken (Adam's ``step``), or 0 (fresh, or no such state)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if step is not None:
                return int(step.item() if isinstance(step, torch.Tensor) else step)
    return 0


def _drop(record: dict[str, Any]) -> None:
    """The writer of the ranks other than 0, and of rank 0 without sinks."""
