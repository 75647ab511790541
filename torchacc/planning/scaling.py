"""From a 3- and a 4-block model to the whole depth: how the planner estimates 70B layouts in seconds.

[Note: per-block scaling] A fake step of a 70B model takes minutes, so the planner never runs one. Per rank, a
transformer's memory is a sum over its blocks plus the rest (embeddings, head, loss): the sharded state of a block
does not depend on the other blocks, nor do the activations it saves, and the transients of the step (one unit
gathered, one block recomputed, the optimizer's temporaries) are those of one block. So each phase's peak (and
its make-up) is affine in the number of blocks ``L`` from a few blocks on: ``b(L) = b(3) + (L - 3) * (b(4) - b(3))``,
read from fake steps of the model cut to 3 and 4 blocks (``with_num_blocks``; see ``FIRST_DEPTH``). Two more facts
keep the number of fake steps small:

* The sharded state is exact arithmetic and is computed apart, at the job's real size: the engine lays the 1-
  and 2-block models out on a fake group of all the GPUs (``fully_shard`` and ``parallelize_module`` on meta
  tensors take a second), and the per-rank parameter bytes extrapolate exactly. FSDP's gradients have the
  shape of its parameter shards, and AdamW holds two tensors like each parameter plus a 4-byte ``step``.
* What is in flight (gathered units, activations, temporaries) depends on the TP size, the checkpointing and
  whether FSDP runs at all, not on how many ranks shard or replicate: it is traced once per (FSDP on, TP size,
  checkpointing) on the smallest job of that shape (2 shards), and the traced state is replaced by the real.

A pipeline is traced per stage (its first and last, at 3 and 4 blocks per stage: ``stage_blocks``,
``cut_blocks``), and carried to the stage's real number of blocks the same way.

Checkpointing 1 block in k is not traced: its per-block increments are those of the checkpointed and plain
blocks (traced for "every block" and "none"), counted as the engine applies them (``matches[::k]``), and its
constant part is that of the kind of the last block, which the backward meets first. CPU offload is read from
the same traces (see ``StepTrace.device_peaks``). ``benchmarks/plan_accuracy.py`` checks all of it against full
fake steps and real runs.
"""

import multiprocessing
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn as nn

from ..distributed.fake import fake_process_group
from ..parallel.engine import shard_model
from ..parallel.layout import Layout
from ..parallel.memory_report import memory_report
from ..parallel.plan import plan_model
from .models import find_blocks, with_num_blocks
from .trace import Breakdown, Held, StepTrace, trace_step

__all__ = [
    "HeldLine",
    "Job",
    "cut_blocks",
    "stage_blocks",
    "depths_for",
    "held_state",
    "scale",
    "trace_depths",
    "trace_groups",
    "traced_held",
    "with_state",
]

FIRST_DEPTH = 3
"""The traces start at 3 blocks: at 2 the first block of the backward is also the one after the last, and the peak
can be a moment of another kind at 2 blocks than at 3 (CPU offload with every block checkpointed: the difference
carried to 8 blocks gave negative activations and +33 %); context parallelism's backward peak also grows from 2 to
3 blocks by more than a block. From 3 blocks on each block adds the same."""


def depths_for(num_blocks: int, interval: int = 1) -> tuple[int, ...]:
    """The depths to trace: two, ``interval`` blocks apart (whole periods of the checkpointing pattern), the first
    >= ``FIRST_DEPTH`` and in step with ``num_blocks``; just ``num_blocks`` for a model no deeper than that."""
    first = FIRST_DEPTH + (num_blocks - FIRST_DEPTH) % interval
    if num_blocks <= first + interval:
        return (num_blocks,)
    return (first, first + interval)


@dataclass(frozen=True)
class HeldLine:
    """A rank's held state as a function of the depth: ``at(d) = first + (d - depth) * per_block``."""

    depth: int
    first: Held
    per_block: Held

    def at(self, depth: int) -> Held:
        steps = depth - self.depth
        return Held(*(getattr(self.first, f.name) + steps * getattr(self.per_block, f.name) for f in fields(Held)))


def scale(
    traces: dict[int, StepTrace], num_blocks: int, *, real: HeldLine | None = None, offload: bool = False
) -> dict[str, Breakdown]:
    """Each phase's peak at ``num_blocks`` blocks from the traces at ``depths_for`` (see [Note: per-block scaling]),
    with the state of the real job (``real``; None: the traced job is the real one). At each traced depth the
    peak is the moment that is the peak for the real job (its gradients weigh in the real proportion; with
    ``offload`` the state weighs nothing), its state is replaced by the real one, then the depths extrapolate."""
    at_depth = {}
    for depth, trace in traces.items():
        traced = trace.held
        held = traced if real is None else real.at(depth)
        weight = held.gradients / traced.gradients if traced.gradients else 1.0
        at_depth[depth] = {
            phase: with_state(
                trace.peak(phase, gradient_weight=weight, offload=offload), traced, held, optimizer=phase == "optimizer"
            )  # fmt: skip
            for phase in trace.frontiers
        }
    if len(at_depth) == 1:
        return next(iter(at_depth.values()))
    (d1, p1), (d2, p2) = sorted(at_depth.items())
    periods = (num_blocks - d1) / (d2 - d1)
    return {phase: p1[phase].extrapolate(p2[phase], periods) for phase in p1}


def traced_held(traces: dict[int, StepTrace]) -> HeldLine:
    """The traced job's held state as a function of the depth (exact: every block holds the same)."""
    return _line({depth: trace.held for depth, trace in traces.items()})


def _line(held: dict[int, Held]) -> HeldLine:
    if len(held) == 1:
        ((depth, first),) = held.items()
        return HeldLine(depth, first, Held(0, 0, 0))
    (d1, h1), (d2, h2) = sorted(held.items())
    per_block = Held(*((getattr(h2, f.name) - getattr(h1, f.name)) // (d2 - d1) for f in fields(Held)))
    return HeldLine(d1, h1, per_block)


def with_state(breakdown: Breakdown, traced: Held, real: Held, *, optimizer: bool = False) -> Breakdown:
    """``breakdown`` of the traced job with its state replaced by that of the real job: gradients in proportion,
    and with ``optimizer`` (the optimizer step's peak) its temporaries too, which are like the parameters."""
    grads = round(breakdown.gradients * real.gradients / traced.gradients) if traced.gradients else 0
    state = {"parameters": real.parameters, "gradients": grads, "optimizer_state": real.optimizer_state}
    values = {f.name: getattr(breakdown, f.name) for f in fields(Breakdown)}
    if optimizer and traced.parameters:
        values["other"] = round(breakdown.other * real.parameters / traced.parameters)
    total = values["other"] + breakdown.activations + breakdown.unsharded + sum(state.values())
    return Breakdown(**{**values, **state, "total": total})


Job = tuple[Layout, tuple[int, ...], bool, int]
"""(layout, per-stage depths, with the optimizer step, rank): one layout's fake steps (see ``trace_depths``)."""


def cut_blocks(layout: Layout, depths: tuple[int, ...], num_blocks: int) -> dict[int, int]:
    """For each per-stage depth of ``depths_for``, the blocks of the model to cut so that each pipeline stage holds
    that many: ``depth * stages``; a single depth is the stage's real share, so the whole model."""
    stages = layout.pipeline.num_stages if layout.pipeline is not None else 1
    if len(depths) == 1:
        return {depths[0]: num_blocks if stages > 1 else depths[0]}
    return {d: d * stages for d in depths}


def stage_blocks(layout: Layout, num_blocks: int) -> tuple[int, int]:
    """Blocks of the first and of the last stage (the default split: earlier stages take one more when the
    stages do not divide the blocks); ``(num_blocks, num_blocks)`` without a pipeline."""
    if layout.pipeline is None:
        return num_blocks, num_blocks
    base, extra = divmod(num_blocks, layout.pipeline.num_stages)
    return base + (extra > 0), base


def trace_depths(
    model: nn.Module, jobs: list[Job], classes: tuple[type[nn.Module], ...], **step: object
) -> list[dict[int, StepTrace]]:
    """Fake steps of ``model`` cut to each depth, for each job (layout, per-stage depths, with the optimizer step,
    rank); the jobs are of one world size and rank."""
    world = {(layout.dims.world_size, rank) for layout, _, _, rank in jobs}
    if len(world) != 1:
        raise AssertionError(f"trace_depths takes jobs of one world size and rank, got {sorted(world)}")
    size, rank = world.pop()
    num_blocks = len(getattr(*find_blocks(model, classes)))
    results = []
    rng = torch.get_rng_state()
    try:
        # one world: DTensor's caches serve every trace in it; the warnings of the real run (once per trace
        # here) would bury the plan: estimate_memory, which runs one step, shows them
        with fake_process_group(world_size=size, rank=rank), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for layout, depths, optimizer_step, _ in jobs:
                cut = {d: with_num_blocks(model, classes, n) for d, n in cut_blocks(layout, depths, num_blocks).items()}
                results.append({d: trace_step(cut[d], layout, optimizer_step=optimizer_step, **step) for d in depths})
    finally:
        torch.set_rng_state(rng)
    return results


_FORKED: tuple | None = None  # what forked workers read: (model, groups, classes, step)


def _run_group(index: int) -> list[dict[int, StepTrace]]:
    if _FORKED is None:
        raise AssertionError("_run_group runs in a worker forked by trace_groups")
    model, groups, classes, step = _FORKED
    return trace_depths(model, groups[index], classes, **step)


def _num_microbatches(layout: Layout) -> int:
    return layout.pipeline.num_stages if layout.pipeline is not None else 1


def trace_groups(
    model: nn.Module,
    groups: list[list[Job]],
    classes: tuple[type[nn.Module], ...],
    *,
    num_workers: int = 1,
    **step: object,
) -> list[list[dict[int, StepTrace]]]:
    """``trace_depths`` of each group (one world size and rank each), in ``num_workers`` forked processes when
    above 1, the longest groups first.

    A fake step is Python-bound, one core each; the workers are forked (they share the meta model and the
    imports, nothing is pickled but the results) and end with ``os._exit``, so no exit handler of this process
    (a process group's teardown among them) runs in them. Without ``fork`` (not Linux) the groups run here.
    """
    global _FORKED
    if num_workers <= 1 or len(groups) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [trace_depths(model, group, classes, **step) for group in groups]
    order = sorted(range(len(groups)), key=lambda i: -max(job[0].dims.world_size for job in groups[i]))
    order = sorted(order, key=lambda i: -sum(len(job[1]) * _num_microbatches(job[0]) for job in groups[i]))
    _FORKED = (model, groups, classes, step)
    try:
        with multiprocessing.get_context("fork").Pool(min(num_workers, len(groups))) as pool:
            results = dict(zip(order, pool.map(_run_group, order, chunksize=1), strict=True))
    finally:
        _FORKED = None
    return [results[i] for i in range(len(groups))]


def held_state(
    model: nn.Module,
    layouts: list[Layout],
    classes: tuple[type[nn.Module], ...],
    *,
    num_blocks: int,
    rank: int = 0,
    last_stage: bool = False,
) -> list[HeldLine]:
    """Each layout's exact state on ``rank`` by (per-stage) depth, from the engine at the real world size; with a
    pipeline ``rank`` holds the first stage, or the last with ``last_stage``."""
    world = {layout.dims.world_size for layout in layouts}
    if len(world) != 1:
        raise AssertionError(f"held_state takes layouts of one world size, got {sorted(world)}")
    results = []
    with fake_process_group(world_size=world.pop(), rank=rank):
        for layout in layouts:
            mesh = layout.dims.build_mesh("cpu")
            held: dict[int, Held] = {}
            cuts = cut_blocks(layout, depths_for(stage_blocks(layout, num_blocks)[last_stage]), num_blocks)
            for depth, size in cuts.items():
                cut = with_num_blocks(model, classes, size)
                shard_model(cut, layout, plan_model(cut, layout, materialize=False), mesh=mesh,
                            device=torch.device("cpu"), materialize=False)  # fmt: skip
                trained = [p for p in cut.parameters() if p.requires_grad]
                params = memory_report(cut).parameters.held_bytes
                grads = _footprint_bytes(trained)
                held[depth] = Held(params, grads, 2 * grads + 4 * len(trained))  # AdamW: two moments and a step
            results.append(_line(held))
    return results


def _footprint_bytes(params: list[torch.Tensor]) -> int:
    total = 0
    for param in params:
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.dtype.itemsize
    return total
