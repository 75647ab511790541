"""One fake training step, laid out by the engine exactly as ``accelerate()`` would: ``trace_step``.

[Note: fake step] Inside a fake process group (``torchacc.distributed.fake``) the model on the meta device goes
through ``plan_model`` and ``shard_model`` (the dry run: see [Note: dry run] in parallel/engine.py), then
``to_empty`` under ``FakeTensorMode`` gives every rank-0 shard a fake storage of the real size, an optimizer
gets its state, and one step runs (forward, backward, optimizer step) while ``LiveBytes`` logs every storage
that grows or shrinks (see [Note: live bytes] in parallel/memory_tracking.py). Rank 0 is the busiest rank: FSDP2
and TP split a dimension like ``torch.chunk``, whose first pieces are the largest. Replaying the log gives, for
each phase, the moments that can be its peak (``StepTrace.frontiers``) and what each is made of: the peak itself,
the peak of what stays on the device when the sharded state lives in host memory (CPU offload, which the trace
cannot run on a CPU), and the peak of a job whose state differs from the traced one (the planner's). A
context-parallel rank is fed what the loader gives it (its chunk of every sequence, ``sequence_split``); a
pipeline stage runs its part of the schedule instead of ``model(**batch)`` (see [Note: fake pipeline step] in
stage_step.py), traced as the rank the caller's fake group names.

AdamW runs with ``foreach=True`` for a CUDA plan (torch's default there) and ``False`` for a CPU one (torch's
default there), and for TP without FSDP, whose mix of DTensor and plain parameters foreach refuses. The two hold
the same state; ``foreach`` adds, during the step, one temporary as large as this rank's parameters
(``torch._foreach_sqrt`` of the second moments, for all parameters at once), where the per-parameter loop needs
three as large as the largest parameter (measured in a real and a fake step alike; tests/unit/test_planning.py).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_scalar_dtype

from .._utils.tied import retie, tied_names
from ..parallel.context import sequence_split
from ..parallel.engine import shard_model
from ..parallel.layout import Layout
from ..parallel.memory_report import MemoryReport, memory_report
from ..parallel.memory_tracking import LiveBytes
from ..parallel.plan import plan_model
from .real_paths import unpacked_batches, values_refused
from .stage_step import StageStep

__all__ = ["Breakdown", "Held", "StepTrace", "trace_step", "causal_lm_batch", "PHASES"]

PHASES = ("forward", "backward", "optimizer")
BatchFn = Callable[[int, int], Mapping[str, Any] | tuple]


@dataclass(frozen=True)
class Breakdown:
    """What the device holds at one moment, in bytes."""

    total: int = 0
    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    """Tensors the forward saved for the backward (its outputs included), still alive."""
    unsharded: int = 0
    """Parameters FSDP gathered for the units at work."""
    other: int = 0
    """Temporaries, communication buffers, the batch and the buffers."""

    @property
    def state(self) -> int:
        """Sharded parameters, gradients and optimizer state: what CPU offload keeps in host memory."""
        return self.parameters + self.gradients + self.optimizer_state

    def extrapolate(self, other: "Breakdown", steps: float) -> "Breakdown":
        """``self + steps * (other - self)``: each field affine in the number of blocks (see planning/plan.py)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Breakdown(**{k: round(v + steps * (getattr(other, k) - v)) for k, v in values.items()})


@dataclass(frozen=True)
class Held:
    """The state one rank holds, in bytes (``memory_report``'s held bytes)."""

    parameters: int
    gradients: int
    optimizer_state: int


@dataclass(frozen=True)
class StepTrace:
    """One fake step of rank 0."""

    report: MemoryReport
    """``memory_report`` of the fake model and optimizer after the step: the exact held bytes."""
    frontiers: dict[str, list[Breakdown]]
    """For each phase, the moments no other moment beats in both gradients and ``total - state``: whatever
    weight the state gets (see ``peak``), the phase's peak is one of them."""

    @property
    def held(self) -> Held:
        report = self.report
        return Held(report.parameters.held_bytes, report.gradients.held_bytes, report.optimizer_state.held_bytes)

    def peak(self, phase: str, *, gradient_weight: float = 1.0, offload: bool = False) -> Breakdown:
        """The phase's peak: the moment of most ``total - state + gradient_weight * gradients`` (parameters and
        optimizer state are constant in a step), or of most ``total - state`` with ``offload``."""
        weight = 0.0 if offload else gradient_weight
        return max(self.frontiers[phase], key=lambda b: b.total - b.state + weight * b.gradients)

    @property
    def peaks(self) -> dict[str, Breakdown]:
        """Each phase's peak."""
        return {phase: self.peak(phase) for phase in self.frontiers}

    @property
    def device_peaks(self) -> dict[str, Breakdown]:
        """Each phase's peak of ``total - state``: the device's with CPU offload."""
        return {phase: self.peak(phase, offload=True) for phase in self.frontiers}


def causal_lm_batch(model: nn.Module) -> BatchFn:
    """``{"input_ids", "labels"}`` of random tokens for a model with ``config.vocab_size`` (a causal LM).

    Raises:
        ValueError: the model has no ``config.vocab_size``.
    """
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(
            f"{type(model).__name__} has no config.vocab_size, so the estimate cannot feed it the causal-LM batch "
            "{'input_ids', 'labels'}; pass batch_fn=lambda batch, seq: {...} returning its inputs"
        )

    def make(batch: int, seq: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch, seq))
        return {"input_ids": ids, "labels": ids}

    return make


def trace_step(
    model: nn.Module,
    layout: Layout,
    *,
    micro_batch_size: int,
    seq_len: int,
    optimizer: str = "adamw",
    batch_fn: BatchFn | None = None,
    block_bytes: int = 1,
    optimizer_step: bool = True,
) -> StepTrace:
    """Lay ``model`` (meta) out with the engine and run one fake step; call it inside a fake process group.

    Args:
        model: a meta-device model; it is sharded in place.
        layout: the layout to trace (with ``compile`` and ``offload_params`` off: see estimate.py).
        micro_batch_size: sequences per rank and step.
        seq_len: tokens per sequence.
        optimizer: "adamw" (the only one so far).
        batch_fn: ``(micro_batch_size, seq_len) -> inputs``; the default feeds a causal LM (``causal_lm_batch``).
        block_bytes: round each storage up to this (512 for CUDA's caching allocator).
        optimizer_step: False stops after the backward (the trace then has no "optimizer" phase).
    """
    if optimizer != "adamw":
        raise ValueError(f"optimizer={optimizer!r} is not supported; use 'adamw'")
    make_batch = batch_fn or causal_lm_batch(model)
    plan = plan_model(model, layout, materialize=False)
    mesh = layout.dims.build_mesh("cpu")  # a CPU mesh: a fake CUDA one would look for a device
    device = torch.device("cpu")
    shard_model(model, layout, plan, mesh=mesh, device=device, materialize=False)
    aliases = tied_names(model.named_parameters(remove_duplicate=False))
    split = sequence_split(layout, _fake_rank())  # outside the fake mode: it reads the rank grid
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=device)
        retie(model, aliases)  # as the engine's materialize does: to_empty unties
        params = [p for p in model.parameters() if p.requires_grad]
        # torch's foreach kernels refuse a mix of DTensor and plain parameters (TP without FSDP keeps norms
        # whole): such a job needs AdamW(foreach=False) on CUDA too, so that is what is traced
        uniform = len({isinstance(p, DTensor) for p in params}) <= 1
        adamw = torch.optim.AdamW(params, lr=1e-4, foreach=block_bytes > 1 and uniform)
        for param in params:  # the state of every step but the first, as AdamW's _init_group makes it
            adamw.state[param] = {
                "step": torch.tensor(0.0, dtype=_get_scalar_dtype()),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
        pipeline = layout.pipeline
        batch = make_batch(micro_batch_size * (pipeline.microbatches if pipeline else 1), seq_len)
        if split is not None:  # what the loader gives this rank: its chunk of every sequence
            batch = split(batch)
        stage_step = StageStep(model, layout, batch) if pipeline is not None else None
        live = LiveBytes(record=True, block_bytes=block_bytes)
        state_keys = live.track(adamw.state)
        param_keys = live.track(list(model.parameters()))
        live.track(list(model.buffers()), batch, stage_step.tensors if stage_step else [])
        with live, values_refused(model), unpacked_batches(batch_fn is None):
            live.mark("forward")
            if stage_step is not None:
                stage_step.run(live)
            else:
                loss = _loss(model(*batch) if isinstance(batch, tuple) else model(**batch))
                live.mark("backward")
                loss.backward()
            if optimizer_step:
                live.mark("optimizer")
                adamw.step()
        report = memory_report(model, adamw)
        grad_keys = live.keys([p.grad for p in model.parameters() if p.grad is not None])
        unsharded_keys = live.keys(_unsharded_params(model))
    categories = {"parameters": param_keys, "optimizer_state": state_keys, "gradients": grad_keys}
    categories["unsharded"] = unsharded_keys
    return StepTrace(report, _replay(live, categories))


def _fake_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if loss is None:
        raise ValueError(
            f"the model returned {type(output).__name__} without a .loss; the estimate needs the loss: return it, or "
            "pass batch_fn inputs that make the model compute it (e.g. labels)"
        )
    return loss if loss.dim() == 0 else loss.float().mean()


def _unsharded_params(model: nn.Module) -> list[torch.Tensor]:
    found = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    found.append(unsharded)
    return found


def _replay(live: LiveBytes, categories: dict[str, set[int]]) -> dict[str, list[Breakdown]]:
    """Each phase's frontier (see ``StepTrace.frontiers``), with the make-up of each moment, from the event log."""
    category = {key: name for name, keys in categories.items() for key in keys}
    sums = dict.fromkeys(["parameters", "gradients", "optimizer_state", "activations", "unsharded", "other"], 0)
    starts = {name: index for index, name in live.phases if name}
    saved = _saved_by_forward(live, starts, category)
    boundaries = sorted((index, name) for index, name in live.phases)
    best: dict[str, dict[int, Breakdown]] = {phase: {} for phase in PHASES if phase in starts}
    total, phase, next_boundary = 0, "", 0
    for index, (key, delta) in enumerate(live.events):
        while next_boundary < len(boundaries) and boundaries[next_boundary][0] <= index:
            phase = boundaries[next_boundary][1]
            next_boundary += 1
        name = category.get(key) or ("activations" if key in saved else "other")
        sums[name] += delta
        total += delta
        if phase in best:
            top = best[phase].get(sums["gradients"])
            if top is None or total > top.total:
                best[phase][sums["gradients"]] = Breakdown(total=total, **sums)
    frontiers = {}
    for phase, by_gradients in best.items():
        kept: list[Breakdown] = []
        for moment in sorted(by_gradients.values(), key=lambda b: -b.gradients):  # most gradients first
            if not kept or moment.total - moment.state > kept[-1].total - kept[-1].state:
                kept.append(moment)
        frontiers[phase] = kept
    return frontiers


def _saved_by_forward(live: LiveBytes, starts: dict[str, int], category: dict[int, str]) -> set[int]:
    """Keys of storages the forward created that are still alive when the backward starts."""
    sizes: dict[int, int] = {}
    created: set[int] = set()
    for index, (key, delta) in enumerate(live.events[: starts["backward"]]):
        if index >= starts["forward"] and key not in sizes:
            created.add(key)
        sizes[key] = sizes.get(key, 0) + delta
    return {key for key in created if sizes[key] > 0 and key not in category}
