"""Mixed precision: which mechanism casts what, and the fp16 gradient scaler.

[Note: one mechanism per layer] With ``compute.bf16`` or ``compute.fp16``:

* FSDP runs use ``MixedPrecisionPolicy(param_dtype=<low>, reduce_dtype=float32)``: parameters are
  stored and updated in float32, all-gathered in the low dtype, and gradients are reduced in
  float32.
* Every run (FSDP, DP or one process) also gets ``torch.autocast(<low>)`` around the model's
  forward, so ops that need float32 (softmax, norms, losses) get it, and the user's loop needs no
  autocast of its own. Floating outputs are returned in float32.

Both layers are on by design: the policy saves communication and memory, autocast keeps the
numerically sensitive ops in float32.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._logging import warn_once

__all__ = ["compute_dtype", "install_autocast", "GradScaler"]

_LOW_DTYPES = (torch.bfloat16, torch.float16)


def compute_dtype(*, bf16: bool, fp16: bool, device: torch.device) -> torch.dtype | None:
    """The low-precision compute dtype (None for float32), warning once when it will be slow here."""
    if bf16:
        if device.type == "cpu" and not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
            warn_once(
                "compute.bf16=True on a CPU without native bf16 (AVX512-BF16 or AMX): bf16 matmuls are emulated "
                "and can be >10x slower than float32; keep compute.bf16=False for CPU speed"
            )
        if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            warn_once(
                f"compute.bf16=True on {torch.cuda.get_device_name(device)}, which has no native bf16: it is slow"
            )
        return torch.bfloat16
    return torch.float16 if fp16 else None


def _to_float32(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.float() if output.dtype in _LOW_DTYPES else output
    if isinstance(output, dict):
        # In place, so dict subclasses such as HF ModelOutput keep their type and attributes.
        for key, value in output.items():
            output[key] = _to_float32(value)
        return output
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        return type(output)(*(_to_float32(v) for v in output))
    if isinstance(output, (list, tuple)):
        return type(output)(_to_float32(v) for v in output)
    return output


class _AutocastForward:
    """A module's forward run under autocast, with floating outputs returned in float32."""

    def __init__(self, forward: Callable[..., Any], device_type: str, dtype: torch.dtype) -> None:
        self.forward = forward
        self.device_type = device_type
        self.dtype = dtype
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            output = self.forward(*args, **kwargs)
        return _to_float32(output)


def install_autocast(model: nn.Module, *, device_type: str, dtype: torch.dtype) -> nn.Module:
    """Run ``model``'s forward under ``torch.autocast(dtype)`` and return float32 outputs.

    The forward is replaced on the instance, so ``model(...)`` keeps firing its hooks (FSDP's
    all-gathers among them) and its parameter names do not change.

    Args:
        model: the model.
        device_type: ``"cuda"`` or ``"cpu"``.
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Returns:
        ``model`` itself.
    """
    model.forward = _AutocastForward(model.forward, device_type, dtype)
    return model


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded and replicated gradients.

    Each rank sees only its shard of the gradients, so an overflow may show on one rank only. This
    scaler combines the overflow flags of all ranks before the step, so every rank skips the same
    steps and changes the scale the same way. Use it exactly like ``torch.amp.GradScaler``.

    Args:
        device: where the gradients are; defaults to this process's device.
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
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return per_device
        # Exactly one all-reduce per rank, even on a rank whose optimizer has no gradient at all.
        any_inf = found_inf.new_zeros(())
        for flag in per_device.values():
            any_inf += flag.to(any_inf.device)
        dist.all_reduce(any_inf, op=dist.ReduceOp.MAX)
        if not per_device:
            per_device[found_inf.device] = found_inf
        for flag in per_device.values():
            flag.copy_(any_inf.clamp(max=1.0))
        return per_device
