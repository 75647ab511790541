"""``estimate_memory``: what one rank of a job will hold, before renting the GPUs, from one fake step.

[Note: estimate] The config is resolved with ``Layout.from_config`` and the model laid out by ``plan_model``,
``layout.dims.build_mesh`` and ``shard_model``, as ``accelerate()`` does, but on the meta device and under a fake
process group of the job's size (see [Note: fake world] and [Note: fake step]); no real process group is
created, no weight allocated, and the caller's process group, random state and default device are as they were.
Parameters, gradients and optimizer state are ``memory_report``'s held bytes of the fake model after the step,
so they equal what ``memory_report`` says in the real job. Two settings are modelled instead of traced: CPU
offload (the peak is then what stays on the device: the fake step's peak without the sharded state, see
``Breakdown.state``; the optimizer step runs on the host) and ``compute.compile`` (traced eagerly).
"""

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import Config
from ..distributed.fake import fake_process_group
from ..parallel.layout import Layout
from ..parallel.memory_report import format_bytes
from ..parallel.plan import plan_model
from .models import ModelSource, build_meta_model
from .trace import BatchFn, Breakdown, Held, StepTrace, trace_step

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_from_peaks", "stage_ranks", "trace_layout"]

_CUDA_BLOCK = 512


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the busiest rank of a planned job (rank 0; with a pipeline, the busiest stage's: ``rank``);
    ``str()`` gives a table.

    Example:
        >>> print(torchacc.estimate_memory(cfg, config, world_size=8, micro_batch_size=1, seq_len=4096))
    """

    parameters: int
    """Sharded parameters (``memory_report(...).parameters.held_bytes`` of the real job)."""
    gradients: int
    optimizer_state: int
    activations: int
    """Saved for the backward (with the configured activation checkpointing), at the peak."""
    peak: int
    """The whole step's peak: the above at that moment, gathered units, communication buffers, temporaries."""
    layout: str
    """``"dp=2 x fsdp=4"``-style."""
    world_size: int
    micro_batch_size: int
    seq_len: int
    peak_phase: str = ""
    """Where the peak is: "forward", "backward" or "optimizer"."""
    offload: bool = False
    """CPU offload: parameters, gradients and optimizer state live in host memory, outside ``peak``."""
    rank: int = 0
    """The rank the estimate speaks for: 0, or with a pipeline the first rank of the busiest stage."""

    @property
    def in_flight(self) -> int:
        """The part of the peak that is neither held state nor activations: gathered units, buffers, temporaries."""
        held = 0 if self.offload else self.parameters + self.gradients + self.optimizer_state
        return max(0, self.peak - held - self.activations)

    def __str__(self) -> str:
        where = "host memory (CPU offload)" if self.offload else "device"
        rows = [
            ("parameters", self.parameters, where),
            ("gradients", self.gradients, where),
            ("optimizer state", self.optimizer_state, where),
            ("activations", self.activations, "at the peak"),
            ("gathered, buffers, temps", self.in_flight, "at the peak"),
            ("peak", self.peak, f"in the {self.peak_phase}" if self.peak_phase else ""),
        ]
        width = max(len(label) for label, _, _ in rows)
        batch = f"micro batch {self.micro_batch_size} x {self.seq_len} tokens"
        lines = [f"rank {self.rank} of {self.world_size}, {self.layout}, {batch}"]
        lines += [
            f"{label.ljust(width)}  {format_bytes(size).rjust(10)}  {note}".rstrip() for label, size, note in rows
        ]
        return "\n".join(lines)


def estimate_memory(
    model: ModelSource,
    config: Config,
    *,
    world_size: int,
    micro_batch_size: int,
    seq_len: int,
    optimizer: str = "adamw",
    device_type: str = "cuda",
    batch_fn: BatchFn | None = None,
) -> MemoryEstimate:
    """Estimate the memory of the busiest rank of ``accelerate(model, loader, config)`` on ``world_size`` ranks.

    Runs the engine on a meta-device copy of the model under a fake process group, then one fake training step
    (forward, backward, AdamW step) of ``micro_batch_size`` sequences of ``seq_len`` tokens: see [Note: estimate].

    Args:
        model: an ``nn.Module`` (on any device; it is copied, not changed), a factory returning one, a
            ``transformers`` config, or a local Hugging Face model directory or ``config.json``.
        config: the ``torchacc.Config`` of the job.
        world_size: the number of ranks (GPUs) of the job.
        micro_batch_size: sequences per rank and step.
        seq_len: tokens per sequence.
        optimizer: "adamw".
        device_type: "cuda" (allocations rounded like CUDA's allocator, foreach AdamW, CPU offload effective) or
            "cpu".
        batch_fn: ``(micro_batch_size, seq_len) -> inputs`` (a dict of keyword arguments or a tuple); the default
            feeds a causal LM ``{"input_ids", "labels"}`` and reads ``.loss``.

    Returns:
        A ``MemoryEstimate`` in bytes.

    Raises:
        ValueError: what ``accelerate()`` would raise for this config and model on ``world_size`` ranks, or a
            model that cannot be built on the meta device (naming the module and the fix).

    Example:
        >>> config = torchacc.Config.from_yaml("train.yaml")
        >>> print(torchacc.estimate_memory("llama-dir/", config, world_size=64, micro_batch_size=1, seq_len=8192))
    """
    for name, value in (("world_size", world_size), ("micro_batch_size", micro_batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    layout = Layout.from_config(config, world_size=world_size, device_type=device_type)
    meta = build_meta_model(model)
    plan_model(meta, layout, materialize=False)  # every check of accelerate(): the trace runs without compile
    found = []
    for rank in stage_ranks(layout):  # a pipeline's stages differ: trace each, keep the busiest
        trace = trace_layout(copy.deepcopy(meta), layout, rank=rank, micro_batch_size=micro_batch_size,
                             seq_len=seq_len, optimizer=optimizer, batch_fn=batch_fn)  # fmt: skip
        peaks = trace.device_peaks if layout.offload_params else trace.peaks
        found.append(estimate_from_peaks(peaks, trace.held, layout, micro_batch_size=micro_batch_size,
                                         seq_len=seq_len, rank=rank))  # fmt: skip
    return max(found, key=lambda estimate: estimate.peak)


def stage_ranks(layout: Layout) -> list[int]:
    """The first rank of each pipeline position (the pipeline is the outermost axis); ``[0]`` without one."""
    pp = layout.dims.pp
    return [p * (layout.dims.world_size // pp) for p in range(pp)]


def trace_layout(model: nn.Module, layout: Layout, *, rank: int = 0, **step: object) -> StepTrace:
    """``trace_step`` of ``model`` (meta, sharded in place) as ``rank`` of a fake group of the layout's size."""
    traced = dataclasses.replace(layout, compile=False, offload_params=False)
    block = _CUDA_BLOCK if layout.device_type == "cuda" else 1
    rng = torch.get_rng_state()
    try:
        with fake_process_group(world_size=layout.dims.world_size, rank=rank):
            return trace_step(model, traced, block_bytes=block, **step)  # type: ignore[arg-type]
    finally:
        torch.set_rng_state(rng)


def estimate_from_peaks(
    peaks: dict[str, Breakdown], held: Held, layout: Layout, *, micro_batch_size: int, seq_len: int, rank: int = 0
) -> MemoryEstimate:
    """The estimate for ``layout`` from each phase's peak (``StepTrace.device_peaks`` with CPU offload) and the
    held state."""
    if layout.offload_params:  # the optimizer step runs on the host; the device holds what is not state
        candidates = {p: b.total - b.state for p, b in peaks.items() if p != "optimizer"}
    else:
        candidates = {p: b.total for p, b in peaks.items()}
    phase = max(candidates, key=lambda p: candidates[p])
    return MemoryEstimate(
        parameters=held.parameters,
        gradients=held.gradients,
        optimizer_state=held.optimizer_state,
        activations=peaks[phase].activations,
        peak=candidates[phase],
        layout=layout.dims.describe(),
        world_size=layout.dims.world_size,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        peak_phase=phase,
        offload=layout.offload_params,
        rank=rank,
    )
