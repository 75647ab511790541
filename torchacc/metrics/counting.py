"""What a record counts: tokens in a batch, FLOPs of a step, the device's peak, the memory peak.

Everything here is host-side and cheap; nothing waits for the device.

[Note: counting tokens] A batch's tokens are counted on the host, as the loader reads it (before it is
copied to the device), so counting never waits for the device:

* a mapping with an ``attention_mask`` on the CPU: its sum (padding does not count); the sequence length is
  the mask's last dimension;
* a mapping with ``input_ids``: their number of elements (an ``attention_mask`` already on a GPU is not
  summed, which would wait for it);
* otherwise the batch's first tensor: its elements when it holds integers in 2 or more dimensions (token
  ids), else its first dimension (samples: a CNN's "tokens" are its images).

Every rank counts the batches its loader reads, before the loader's transform: under context parallelism the
whole sequences, not this rank's chunk of them (nor the padding that makes their length divide). The ranks of
one TP group, one CP group and one pipeline read the same batches, so the record divides the sum over all ranks
by ``world size / data-parallel ranks`` (``tp x cp x pp``): each token counts once.

[Note: MFU] Model FLOPs per token are ``6 * N`` for the trainable parameters ``N`` (forward 2, backward 4;
each tied parameter counts once), plus ``12 * L * d * T`` for attention (the score and value products of
``L`` layers of width ``d`` over a sequence of ``T`` tokens, forward and backward; causal masking is not
halved), as in the PaLM paper's appendix B and TorchTitan. ``L`` and ``d`` come from a Hugging Face model's
config; other models get no attention term. ``N`` is the whole model's: a DTensor's ``numel`` is its global
one (FSDP, TP), and under pipeline parallelism the stages' counts are summed over the pipeline once, at
installation. ``T`` is the whole sequence's length, also under context parallelism. MFU is those FLOPs over the
wall time, the number of devices and one device's peak.
"""

import os
import resource
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from .._utils.tree import iter_tensors

__all__ = ["count_tokens", "attention_shape", "peak_flops_of", "memory_peak"]

# Dense bf16 FLOP/s of one device, by a name fragment of torch.cuda.get_device_name(); the first match wins.
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM (the "80GB HBM3" parts)
    ("H200", 989e12),
    ("A100", 312e12),
    ("B200", 2250e12),
)


def count_tokens(batch: Any) -> tuple[int, int]:
    """``(tokens, tokens x sequence length)`` of one host batch (see [Note: counting tokens]).

    Example:
        >>> count_tokens({"input_ids": torch.zeros(4, 128, dtype=torch.long)})
        (512, 65536)
    """
    if isinstance(batch, Mapping):
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
        if isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and mask.dim() >= 1:
            tokens = int(mask.sum())
            return tokens, tokens * mask.shape[-1]
        if isinstance(ids, torch.Tensor):
            return _sequence(ids)
    first = next(iter_tensors(batch), None)
    if first is None:
        return 0, 0
    if first.dim() >= 2 and not first.is_floating_point() and not first.is_complex():
        return _sequence(first)
    return (first.shape[0] if first.dim() else 1), 0


def _sequence(ids: torch.Tensor) -> tuple[int, int]:
    tokens = ids.numel()
    return tokens, tokens * (ids.shape[-1] if ids.dim() >= 1 else 1)


def attention_shape(model: nn.Module) -> tuple[int, int] | None:
    """``(layers, width)`` of a Hugging Face transformer's config for the attention FLOPs, or None."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if isinstance(layers, int) and isinstance(width, int):
        return layers, width
    return None


def peak_flops_of(device: torch.device) -> float | None:
    """The dense bf16 peak FLOP/s of a known accelerator (see ``PEAK_FLOPS``); None on others and on the CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for fragment, flops in PEAK_FLOPS if fragment in name), None)


def memory_peak(device: torch.device) -> tuple[int, int]:
    """``(peak bytes, capacity bytes)`` of this process so far: CUDA ``max_memory_allocated`` and the device's
    memory; on the CPU the peak resident set size and the machine's physical memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    try:
        capacity = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        capacity = 0
    return peak, capacity
