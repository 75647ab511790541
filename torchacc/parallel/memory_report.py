"""``memory_report()``: what the training state costs this rank, next to what the unsharded model costs.

The FSDP2 seed's ``get_memory_stats()`` in torchacc's form. It counts three kinds of state:

* parameters: ``model.parameters()``, so a tied parameter counts once;
* gradients: those that exist now (``p.grad is not None``): none before the first backward, nor after
  ``optimizer.zero_grad()``;
* optimizer state: every tensor in ``optimizer.state``. That includes AdamW's ``step``, a 0-dim float32
  tensor per parameter: it is not sharded, so it counts whole in both columns (4 bytes per parameter).

"Held" is what this rank stores: a DTensor's local shard (``to_local()``, the ``torch.chunk`` share of
its first dim), a plain tensor whole. "Full" is the same state of the unsharded model: a DTensor's full
shape, a plain tensor as is. Buffers are left out: FSDP2 does not shard them, so every layout keeps a
whole copy on each rank. Neither column counts what lives only while a step runs (a unit's all-gathered
parameters, activations): ``peak_bytes`` does, measured (CUDA's ``max_memory_allocated``, or on the CPU the
peak of ``torchacc.track_memory()``). Nothing here communicates: any rank may call it alone.
"""

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..distributed import env
from .memory_tracking import tracked_peak_bytes

__all__ = ["Footprint", "MemoryReport", "memory_report", "log_summary"]

_LOGGER = logging.getLogger("torchacc")


@dataclass(frozen=True)
class Footprint:
    """Elements and bytes of one kind of state: held on this rank, and in the full (unsharded) model."""

    held_numel: int
    held_bytes: int
    full_numel: int
    full_bytes: int

    @property
    def reduction(self) -> float:
        """``full_bytes / held_bytes``: 1.0 when nothing exists, ``inf`` when this rank holds none of it."""
        if self.held_bytes == 0:
            return 1.0 if self.full_bytes == 0 else math.inf
        return self.full_bytes / self.held_bytes

    def __add__(self, other: "Footprint") -> "Footprint":
        return Footprint(
            self.held_numel + other.held_numel,
            self.held_bytes + other.held_bytes,
            self.full_numel + other.full_numel,
            self.full_bytes + other.full_bytes,
        )


@dataclass(frozen=True)
class MemoryReport:
    """The training state of one rank; ``str()`` gives a table, ``summary()`` one line."""

    parameters: Footprint
    gradients: Footprint
    optimizer_state: Footprint
    num_units: int  # modules that are FSDPModule, root included; 0 for DP or one process
    mesh_shape: tuple[int, ...] | None  # None without a mesh (DP, one process)
    mesh_dim_names: tuple[str, ...] | None
    rank: int
    world_size: int
    peak_bytes: int | None = None
    """The measured peak of this rank's device: CUDA's ``max_memory_allocated``; on the CPU the peak of live tensor
    bytes of the latest ``with torchacc.track_memory():`` block (None when no block ran)."""

    @property
    def total(self) -> Footprint:
        """Parameters, gradients and optimizer state together."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def reduction(self) -> float:
        """Full bytes over held bytes, all kinds together: how many times less this rank holds."""
        return self.total.reduction

    @property
    def layout(self) -> str:
        """``FSDP mesh (fsdp=2)``, ``HSDP mesh (dp=2, fsdp=2)``, ``DP (no mesh)`` or ``one process (no mesh)``."""
        if self.mesh_shape is None:
            return "DP (no mesh)" if self.world_size > 1 else "one process (no mesh)"
        kind = "FSDP" if len(self.mesh_shape) == 1 else "HSDP"
        return f"{kind} mesh ({self._axes()})"

    def _axes(self) -> str:
        names = self.mesh_dim_names or tuple(f"dim{i}" for i in range(len(self.mesh_shape or ())))
        return ", ".join(f"{name}={size}" for name, size in zip(names, self.mesh_shape or (), strict=True))

    def _units(self) -> str:
        return f"{self.num_units} unit{'' if self.num_units == 1 else 's'}"

    def summary(self) -> str:
        """One line: the layout and the parameters this rank holds (what ``accelerate()`` logs)."""
        p = self.parameters
        if self.mesh_shape is None:
            where = f"DP over {self.world_size} ranks" if self.world_size > 1 else "one process"
            return f"torchacc: {where}, nothing sharded; parameters {format_bytes(p.held_bytes)} per rank"
        kind = self.layout.split()[0]
        return (
            f"torchacc: {kind} over {self.world_size} ranks ({self._axes()}), {self._units()}; parameters "
            f"{format_bytes(p.held_bytes)} of {format_bytes(p.full_bytes)} per rank ({p.reduction:.2f}x less)"
        )

    def __str__(self) -> str:
        rows = [("", "held on this rank", "full model", "reduction")]
        for label, size in (
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("total", self.total),
        ):
            ratio = "-" if size.full_bytes == 0 else f"{size.reduction:.2f}x"
            rows.append((label, format_bytes(size.held_bytes), format_bytes(size.full_bytes), ratio))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [f"rank {self.rank} of {self.world_size}, {self.layout}, {self._units()}"]
        for row in rows:
            label, *cells = row
            padded = [cell.rjust(width) for cell, width in zip(cells, widths[1:], strict=True)]
            lines.append("  ".join([label.ljust(widths[0]), *padded]).rstrip())
        if self.peak_bytes is not None:
            lines.append(f"{'peak (measured)'.ljust(widths[0])}  {format_bytes(self.peak_bytes).rjust(widths[1])}")
        return "\n".join(lines)


def format_bytes(num_bytes: int) -> str:
    """``512 B``, ``12.5 KiB``, ``1.2 GiB``: powers of 1024, one decimal."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    units = ("KiB", "MiB", "GiB", "TiB")
    value, index = num_bytes / 1024, 0
    while value >= 1024 and index < len(units) - 1:
        value, index = value / 1024, index + 1
    return f"{value:.1f} {units[index]}"


def _footprint(tensors: list[torch.Tensor]) -> Footprint:
    held_numel = held_bytes = full_numel = full_bytes = 0
    for tensor in tensors:
        held = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        held_numel += held.numel()
        held_bytes += held.numel() * held.dtype.itemsize
        full_numel += tensor.numel()  # a DTensor's numel is that of its full shape
        full_bytes += tensor.numel() * tensor.dtype.itemsize
    return Footprint(held_numel, held_bytes, full_numel, full_bytes)


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Count the parameters, gradients and optimizer state this rank holds, and those of the full model.

    Works for FSDP, HSDP, DP and one process alike, before or after training steps; it does not
    communicate, so it may run on one rank only.

    Args:
        model: the model (accelerated or not); its buffers are not counted.
        optimizer: its state tensors are counted (AdamW's ``step`` included); None counts none.

    Returns:
        A frozen ``MemoryReport`` for this rank: ``parameters``, ``gradients`` and ``optimizer_state``
        (each a ``Footprint`` of held and full elements and bytes), ``total``, ``reduction``,
        ``num_units``, ``mesh_shape``, ``mesh_dim_names``, ``rank``, ``world_size`` and ``peak_bytes`` (the
        measured peak: CUDA's ``max_memory_allocated``, on the CPU that of the latest
        ``torchacc.track_memory()`` block, else None). ``str()`` of it is a table.

    Example:
        >>> report = torchacc.memory_report(model, optimizer)
        >>> if torchacc.dist.rank() == 0:
        ...     print(report)
        rank 0 of 2, FSDP mesh (fsdp=2), 4 units
                         held on this rank  full model  reduction
        parameters                12.5 KiB    25.0 KiB      1.99x
        ...
    """
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states: list[torch.Tensor] = []
    if optimizer is not None:
        states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
    return MemoryReport(
        parameters=_footprint(params),
        gradients=_footprint(grads),
        optimizer_state=_footprint(states),
        num_units=sum(1 for m in model.modules() if isinstance(m, FSDPModule)),
        mesh_shape=None if mesh is None else tuple(mesh.shape),
        mesh_dim_names=None if mesh is None or mesh.mesh_dim_names is None else tuple(mesh.mesh_dim_names),
        rank=env.rank(),
        world_size=env.world_size(),
        peak_bytes=tracked_peak_bytes(params[0].device if params else env.device()),
    )


def log_summary(model: nn.Module) -> None:
    """Log ``memory_report(model).summary()`` on rank 0, at INFO, through the ``"torchacc"`` logger."""
    if env.rank() == 0 and _LOGGER.isEnabledFor(logging.INFO):
        _LOGGER.info(memory_report(model).summary())
