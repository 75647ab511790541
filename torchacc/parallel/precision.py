"""Mixed precision: one mechanism casts, the fp16 gradient scaler.

[Note: one precision mechanism] With ``compute.bf16`` or ``compute.fp16`` exactly one mechanism
lowers the precision of the forward and backward (TorchTitan's rule):

* FSDP and HSDP runs use FSDP2's ``MixedPrecisionPolicy(param_dtype=<low>, reduce_dtype=...)``: each
  unit's parameters are all-gathered in the low dtype and the whole unit computes in it; the sharded
  float32 parameters are what the optimizer updates. No autocast runs on top of it.
* Runs without a mesh (plain DP, one process) have nothing that casts parameters, so the forward runs
  under ``torch.autocast(<low>)``: matmuls in the low dtype, the ops autocast keeps in float32
  (softmax, norms, losses) in float32.

The two agree within bf16 rounding, so ``dist.fsdp.size`` 1 and 2 train alike. In both, scalar
floating outputs (the loss) are returned in float32; larger outputs (logits) stay in the compute dtype,
since a float32 copy of the logits costs twice their memory: call ``.float()`` on them before a loss
computed outside the model.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._utils.logging import warn_once
from .._utils.tree import map_tensors

__all__ = ["compute_dtype", "install_precision", "GradScaler"]

_LOW_DTYPES = (torch.bfloat16, torch.float16)


def compute_dtype(low: torch.dtype | None, *, device: torch.device) -> torch.dtype | None:
    """The low-precision compute dtype ``low`` (None for float32), warning once when it will be slow here."""
    if low == torch.bfloat16:
        if device.type == "cpu" and not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
            warn_once(
                "compute.bf16=True on a CPU without native bf16 (AVX512-BF16 or AMX): bf16 matmuls are emulated "
                "and can be >10x slower than float32; keep compute.bf16=False for CPU speed"
            )
        if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            warn_once(
                f"compute.bf16=True on {torch.cuda.get_device_name(device)}, which has no native bf16: it is slow"
            )
    return low


def _scalars_to_float32(output: Any) -> Any:
    return map_tensors(lambda t: t.float() if t.dtype in _LOW_DTYPES and t.dim() == 0 else t, output)


class _PrecisionForward:
    """A module's forward, under autocast when given a dtype, with scalar floating outputs in float32."""

    def __init__(self, forward: Callable[..., Any], device_type: str, autocast_dtype: torch.dtype | None) -> None:
        self.forward = forward
        self.device_type = device_type
        self.autocast_dtype = autocast_dtype
        functools.update_wrapper(self, forward, updated=())  # not __dict__: it would bring a wrapped wrapper's forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast_dtype is None:
            return _scalars_to_float32(self.forward(*args, **kwargs))
        with torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype):
            output = self.forward(*args, **kwargs)
        return _scalars_to_float32(output)


def install_precision(model: nn.Module, *, device_type: str, autocast_dtype: torch.dtype | None) -> nn.Module:
    """Return scalar outputs in float32 and, with ``autocast_dtype``, run the forward under autocast.

    See [Note: one precision mechanism]: pass ``autocast_dtype`` only when nothing else (no FSDP
    ``MixedPrecisionPolicy``) casts the parameters. The forward is replaced on the instance, so
    ``model(...)`` keeps firing its hooks (FSDP's all-gathers among them) and no name changes.

    Args:
        model: the model.
        device_type: ``"cuda"`` or ``"cpu"``.
        autocast_dtype: ``torch.bfloat16`` or ``torch.float16``, or None for no autocast.

    Returns:
        ``model`` itself.
    """
    model.forward = _PrecisionForward(model.forward, device_type, autocast_dtype)
    return model


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose device defaults to this process's device type, and whose overflow check
    covers every rank: when any rank finds an inf or NaN, every rank skips the step and backs off alike.

    [Note: found_inf across ranks] Each rank checks and unscales its local gradients (a DTensor's local
    shard), then one all-reduce (max) of the overflow flag over all ranks makes the decision global.
    DTensor's own handling of the check is not enough once tensor parallelism is on: it reduces the flag
    over the mesh of the first gradient only (under FSDP x TP some gradients live on the ``fsdp`` mesh,
    others on ``(fsdp, tp)``, so an inf on one TP rank could stay there), and it refuses the mix of DTensor
    gradients (split layers) and plain ones (layers kept whole on a TP-only mesh) in one call. Plain
    gradients of replicated layers are identical across a TP group by construction, but the split ones are
    not. The all-reduce costs one scalar per step; DDP's gradients are already equal on all ranks.
    Use it exactly like ``torch.amp.GradScaler``.

    Args:
        device: where the gradients are; defaults to ``"cuda"`` when CUDA is present, else ``"cpu"``.
        **kwargs: ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``enabled``.

    Example:
        >>> scaler = torchacc.GradScaler()
        >>> scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
    """

    def __init__(self, device: str | torch.device | None = None, **kwargs: Any) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(torch.device(device).type, **kwargs)

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """torch's ``_unscale_grads_`` on local tensors, then the flag agreed over all ranks; see
        [Note: found_inf across ranks]. Returns the overflow flag per device, as torch's does."""
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()  # duplicate indices may overflow once summed
                        grad = grad._values()
                    local = grad.to_local() if isinstance(grad, DTensor) else grad  # a view: unscaled in place
                    grads.setdefault(local.device, {}).setdefault(local.dtype, []).append(local)
            flags = {device: found_inf.to(device, copy=True) for device in grads}
            for device, per_dtype in grads.items():
                scale = inv_scale.to(device)
                for tensors in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(tensors, flags[device], scale)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                anywhere = found_inf.clone()  # every rank joins, even one without gradients
                for flag in flags.values():
                    anywhere = torch.maximum(anywhere, flag.to(anywhere.device))
                dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
                for flag in flags.values():
                    flag.copy_(anywhere)
        return flags
