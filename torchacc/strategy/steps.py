"""The step half of ``FSDP2Strategy``: forward, backward and optimizer steps with gradient accumulation.

A micro-step's gradients are synchronized across ranks only on the last micro-step of an
accumulation (``accumulation_steps``, set by ``FSDP2Strategy.setup_environment``); the optimizer
steps, after clipping, only then. Under pipeline parallelism (``dist.pp.size > 1``) ``training_step`` runs
the forward and the backward of the micro-batch through the pipeline schedule (``torchacc.train_step``), and
``backward`` only counts it: the loop is the same (see [Note: one training loop] in
``torchacc/parallel/pipeline_step.py``); each micro-step then synchronizes its stage's gradients.

With fp16 compute (``mp_policy="fp16"`` or ``compute.fp16``) a
``GradScaler`` scales each micro-step's loss, unscales the gradients before clipping, and skips the
step (and halves the scale) when any rank saw an inf or NaN.
"""

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from ..checkpoint.optimizer import load_optim_state_dict
from ..distributed.mesh import fsdp_submesh
from ..parallel.clip_grad import clip_grad_norm_
from ..parallel.pipeline_step import is_pipelined, train_step
from ..parallel.precision import GradScaler

__all__ = ["StrategyStepsMixin"]


class StrategyStepsMixin:
    """Step methods of ``FSDP2Strategy`` (see there for the constructor arguments they read)."""

    accumulation_steps: int
    max_norm: float
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None
    defer_replica_all_reduce: bool
    device_mesh: DeviceMesh | None
    global_step: int
    scaler: GradScaler | None
    _micro_step: int
    _backward_done: bool
    _pending_optimizer_state: Any

    def _ready(self) -> dict[str, Any]:  # provided by FSDP2Strategy
        raise NotImplementedError

    def _require_model(self) -> nn.Module:  # provided by FSDP2Strategy
        raise NotImplementedError

    # --- steps -----------------------------------------------------------------------------------

    def _loss(self, batch: Any) -> torch.Tensor:
        model = self._require_model()
        if self.loss_fn is not None:
            return self.loss_fn(model, batch)
        output = model(**batch) if isinstance(batch, Mapping) else model(batch)
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if loss is None:
            raise ValueError("the model's output has no .loss; give FSDP2Strategy a loss_fn=fn(model, batch)")
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Forward one micro-batch under the precision policy; returns the loss.

        Under pipeline parallelism the backward runs here too (the schedule interleaves them); ``backward``
        then only counts the micro-step.
        """
        model = self._require_model()
        if is_pipelined(model):
            scale = 1.0 / self.accumulation_steps
            if self.scaler is not None:  # scale(1) starts the scaler's scale as scale(loss) would
                scale *= float(self.scaler.scale(torch.ones((), device=self._ready()["device"])))
            loss = train_step(model, batch, scale=scale)
            self._backward_done = True
            return loss
        self._set_gradient_sync(model, last=(self._micro_step + 1) % self.accumulation_steps == 0)
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The loss of one batch, without gradients."""
        with torch.no_grad():
            return self._loss(batch)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """As ``validation_step``."""
        return self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """The model's outputs for one batch, without gradients."""
        model = self._require_model()
        with torch.no_grad():
            return model(**batch) if isinstance(batch, Mapping) else model(batch)

    def backward(self, loss: torch.Tensor, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Backward of one micro-step; gradients are synchronized only on the last one of an accumulation."""
        self._ready()
        self._micro_step += 1
        if self._backward_done:  # a pipeline's training_step ran it already
            self._backward_done = False
            return
        self._set_gradient_sync(model, last=self._micro_step % self.accumulation_steps == 0)
        loss = loss / self.accumulation_steps
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _set_gradient_sync(self, model: nn.Module, *, last: bool) -> None:
        # Set before the forward as well as before the backward: DDP reads the flag in its forward
        # hook, FSDP2 in its backward hooks.
        shard_mesh = fsdp_submesh(self.device_mesh)  # without the "tp" axis
        hsdp = isinstance(model, FSDPModule) and shard_mesh is not None and shard_mesh.ndim == 2
        if self.defer_replica_all_reduce and hsdp:
            model.set_requires_all_reduce(last)
        elif hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, model: nn.Module, scheduler: Any = None) -> float | None:
        """Step after the last micro-step of an accumulation: restore deferred state, clip, step, zero.

        With fp16 the gradients are unscaled before clipping, and a step whose gradients hold an inf or
        NaN on any rank is skipped on every rank (the scheduler does not step either) while the scale backs off.

        Returns:
            The global gradient norm before clipping (a float, the same on every rank) when ``max_norm`` is
            set and a step was due; None otherwise.
        """
        if self._micro_step % self.accumulation_steps:
            return None
        if self._pending_optimizer_state is not None:
            load_optim_state_dict(model, optimizer, self._pending_optimizer_state)
            self._pending_optimizer_state = None
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        norm = clip_grad_norm_(model.parameters(), self.max_norm) if self.max_norm > 0 else None
        stepped = True
        if self.scaler is None:
            optimizer.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(optimizer)  # skipped when any rank found an inf or NaN
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale
        if scheduler is not None and stepped:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return norm

    def create_optimizer(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        **kwargs: Any,
    ) -> torch.optim.AdamW:
        """AdamW over ``model``'s trainable parameters, grouped by weight decay and dtype.

        Matrices (``dim >= 2``: linear and embedding weights) decay; biases and norm weights do not.
        """
        groups: dict[tuple[bool, torch.dtype], list[nn.Parameter]] = {}
        for param in model.parameters():
            if param.requires_grad:
                groups.setdefault((param.dim() >= 2, param.dtype), []).append(param)
        param_groups = [
            {"params": params, "weight_decay": weight_decay if decay else 0.0}
            for (decay, _), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], str(kv[0][1])))
        ]
        return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, **kwargs)
