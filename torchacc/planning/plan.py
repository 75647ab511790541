"""``plan_layouts``: every layout we offer for a model on a cluster, which fit, and how fast each would run.

For each candidate (candidates.py) the config is resolved and the model checked exactly as ``accelerate()`` does
(``Layout.from_config``, ``plan_model``): a refusal is kept with its message. The memory of the others comes
from a few fake steps carried to the full depth (see [Note: per-block scaling] in scaling.py), the speed from
the cost model (see [Note: cost model] in costs.py).
"""

import copy
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.nn as nn

from ..config import Config
from ..parallel.layout import Layout, PipelineSchedule
from ..parallel.plan import plan_model
from .candidates import AXES, Candidate, Choice, Cluster, enumerate_candidates, worth_trying
from .costs import Hardware, ModelShape, StepCost, step_cost
from .estimate import MemoryEstimate, estimate_from_peaks
from .models import ModelSource, build_meta_model, find_blocks
from .scaling import depths_for, held_state, scale, stage_blocks, trace_groups, traced_held

__all__ = ["Plan", "PlannedLayout", "plan_layouts"]


@dataclass(frozen=True)
class PlannedLayout:
    """One layout that can exist: its config, per-rank memory and step cost."""

    candidate: Candidate
    config: Config
    estimate: MemoryEstimate
    cost: StepCost
    fits: bool


@dataclass(frozen=True)
class Plan:
    """What ``plan_layouts`` found: the layouts that can exist (fastest first) and those that cannot."""

    layouts: list[PlannedLayout]
    refused: list[tuple[Candidate, str]]
    shape: ModelShape
    cluster: Cluster
    hardware: Hardware

    @property
    def fitting(self) -> list[PlannedLayout]:
        return [row for row in self.layouts if row.fits]

    @property
    def best(self) -> PlannedLayout | None:
        return next(iter(self.fitting), None)


TraceKey = tuple[bool, int, int | None, PipelineSchedule | None, int, bool | int]


def _trace_key(layout: Layout) -> TraceKey:
    """What the traced part depends on: FSDP on, the TP size, the checkpointing interval (None: none), the pipeline
    (stages, microbatches, schedule), the CP size, ``reshard_after_forward``."""
    ac = layout.checkpointing
    dims = layout.dims
    interval = None if ac is None else ac.interval
    return dims.sharded, dims.tp, interval, layout.pipeline, dims.cp, layout.reshard_after_forward


def _plain_key(key: TraceKey) -> TraceKey:
    return key[0], key[1], None, key[3], key[4], key[5]


def _positions(layout: Layout) -> tuple[bool, ...]:
    """The stages that can be the busiest: the first (the embedding, the most microbatches in flight) and the last
    (the head, every microbatch's logits); without a pipeline, the one model."""
    return (False, True) if layout.pipeline is not None else (False,)


def _rank_of(layout: Layout, last: bool) -> int:
    """The first rank of the first or last pipeline position (the pipeline is the outermost axis)."""
    return (layout.dims.pp - 1) * (layout.dims.world_size // layout.dims.pp) if last else 0


def _trace_layout(config: Config, layout: Layout) -> Layout:
    """The smallest job of ``layout``'s shape: FSDP over 2 ranks when it runs (times the CP ranks, which shard
    too)."""
    config = copy.deepcopy(config)
    sharded, tp, _, _, cp, raf = _trace_key(layout)
    fsdp = 2 if sharded and (cp == 1 or layout.dims.fsdp > 1) else 1
    if sharded and not isinstance(raf, bool) and cp == 1:
        # after forward each unit stays sharded over raf ranks, whatever the FSDP size: trace the smallest job
        # where raf is a proper divisor of the shards, as FSDP2 requires
        fsdp = 2 * raf
    else:
        raf = raf if sharded and isinstance(raf, bool) else True
    config.dist.fsdp.size, config.dist.dp.size, config.dist.tp.size, config.dist.cp.size = fsdp, 1, tp, cp
    config.dist.fsdp.reshard_after_forward = raf
    world = fsdp * tp * cp * layout.dims.pp
    return Layout.from_config(config, world_size=world, device_type=layout.device_type)


def model_shape(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> ModelShape:
    """Counts from a meta model: parameters (tied ones once), block parameters, blocks, width, vocabulary."""
    found = find_blocks(model, classes)
    blocks = list(getattr(found[0], found[1])) if found else []
    config = getattr(model, "config", None)
    hidden = next((getattr(config, n) for n in ("hidden_size", "n_embd", "d_model") if hasattr(config, n)), 0)
    return ModelShape(
        num_params=sum(p.numel() for p in model.parameters()),
        num_block_params=sum(p.numel() for block in blocks for p in block.parameters()),
        num_blocks=len(blocks),
        hidden_size=int(hidden or 0),
        vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        num_heads=int(getattr(config, "num_attention_heads", 0) or 0),
        num_kv_heads=int(
            getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 0) or 0
        ),
    )


def default_config(model: nn.Module, *, bf16: bool) -> Config:
    """The base config: the model's blocks as FSDP units (Hugging Face's ``_no_split_modules``, else the class
    of its largest module list), ``compute.bf16`` as asked."""
    config = Config()
    config.compute.bf16 = bf16
    names = list(getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    names = [n for n in names if n in present]
    if not names:
        found = find_blocks(model, tuple({type(m) for m in model.modules()}))
        if found is not None:
            names = [type(getattr(found[0], found[1])[0]).__name__]
    config.dist.fsdp.wrap_layer_cls = set(names)
    return config


def plan_layouts(
    model: ModelSource,
    *,
    cluster: Cluster,
    micro_batch_size: int,
    seq_len: int,
    hardware: Hardware | None = None,
    config: Config | None = None,
    bf16: bool = False,
    optimizer: str = "adamw",
    num_workers: int | None = None,
    axes: Sequence[Callable[[Cluster], list[Choice]]] | None = None,
) -> Plan:
    """Try every candidate layout of ``model`` on ``cluster``; see the module docstring.

    Args:
        model: what ``estimate_memory`` takes (a module, a factory, a transformers config, a path).
        cluster: the GPUs: count, per node, the k of "checkpoint 1 block in k".
        micro_batch_size: sequences per rank and step.
        seq_len: tokens per sequence.
        hardware: memory, peak FLOPs and bandwidths (H100 defaults).
        config: the base config (the candidates set the parallel sizes, checkpointing and offload on a copy);
            default: ``default_config``.
        bf16: ``compute.bf16`` for the default config.
        optimizer: "adamw".
        num_workers: processes for the fake steps (forked; default: the CPUs this process may use, at most 4).
        axes: the candidate axes (default ``candidates.AXES``; see [Note: candidate axes]).

    Returns:
        A ``Plan``: ``layouts`` sorted by tokens per second per GPU (those that fit first), ``refused`` with the
        error ``accelerate()`` would raise.
    """
    hardware = hardware or Hardware()
    if num_workers is None:
        num_workers = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    meta = build_meta_model(model)
    base = config if config is not None else default_config(meta, bf16=bf16)
    candidates = enumerate_candidates(cluster, axes=tuple(AXES if axes is None else axes))
    if axes is None:  # see [Note: which PP and CP layouts]
        candidates = [c for c in candidates if worth_trying(c, seq_len=seq_len)]
    valid, refused = _resolve(meta, base, candidates, cluster.num_gpus)
    if not valid and len({error for _, error in refused}) == 1:  # the base config itself cannot be
        raise ValueError(refused[0][1])
    classes = tuple({type(m) for m in meta.modules() if type(m).__name__ in base.dist.fsdp.wrap_layer_cls})
    shape = model_shape(meta, classes)
    if shape.num_blocks < 2:
        raise ValueError(
            f"{type(meta).__name__} has {shape.num_blocks} block(s) of dist.fsdp.wrap_layer_cls "
            f"{sorted(base.dist.fsdp.wrap_layer_cls)} in a module list; the planner scales fake steps of a few "
            "blocks to the depth: set wrap_layer_cls (in the base config) to the class of the repeated blocks"
        )
    step = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "optimizer": optimizer}
    traces = _traces(meta, valid, classes, step, shape.num_blocks, num_workers)
    helds = _helds(meta, valid, classes, shape.num_blocks)
    rows = []
    for candidate, cfg, layout in valid:
        key, found = _trace_key(layout), []
        for last in _positions(layout):  # a pipeline: the busier of its first and last stages
            traced = traces[(key, last)]
            line = helds.get((layout.dims, last)) if layout.dims.sharded else None
            blocks = stage_blocks(layout, shape.num_blocks)[last]
            peaks = scale(traced, blocks, real=line, offload=layout.offload_params)
            if "optimizer" not in peaks:  # checkpointing changes nothing in the optimizer step: see _traces
                plain = traces[(_plain_key(key), last)]
                peaks["optimizer"] = scale(plain, blocks, real=line, offload=layout.offload_params)["optimizer"]
            real = (line or traced_held(traced)).at(blocks)
            found.append(estimate_from_peaks(peaks, real, layout, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                             rank=_rank_of(layout, last)))  # fmt: skip
        estimate = max(found, key=lambda e: e.peak)
        cost = step_cost(shape, layout, hardware, micro_batch_size=micro_batch_size, seq_len=seq_len,
                         gpus_per_node=cluster.node_size)  # fmt: skip
        rows.append(PlannedLayout(candidate, cfg, estimate, cost, estimate.peak <= hardware.usable_bytes))
    rows.sort(key=lambda row: (not row.fits, -round(row.cost.tokens_per_s), row.estimate.peak))  # ties: less memory
    return Plan(rows, refused, shape, cluster, hardware)


def _resolve(
    meta: nn.Module, base: Config, candidates: list[Candidate], world_size: int
) -> tuple[list[tuple[Candidate, Config, Layout]], list[tuple[Candidate, str]]]:
    """Each candidate's config and layout, or the error ``accelerate()`` would raise for it; a candidate whose
    setting ``accelerate()`` ignores (CPU offload without sharding) is the same layout as one without it: dropped."""
    valid, refused, checked, seen = [], [], {}, set()
    for candidate in candidates:
        cfg = candidate.config(base)
        try:
            layout = Layout.from_config(cfg, world_size=world_size, device_type="cuda")
            # the whole layout (plan_model reads compile, the TP plan, the schedule...); its repr: a dict TP plan
            # is a mapping proxy, which does not hash
            key = repr(dataclasses.replace(layout, ignored=()))
            if key not in checked:
                try:
                    plan_model(meta, layout, materialize=False)
                    checked[key] = None
                except ValueError as exc:
                    checked[key] = exc
            if checked[key] is not None:
                raise checked[key]
        except ValueError as exc:
            refused.append((candidate, " ".join(str(exc).split())))
            continue
        if cfg.memory.offload_params and not layout.offload_params and key in seen:
            continue
        seen.add(key)
        valid.append((candidate, cfg, layout))
    return valid, refused


def _traces(meta: nn.Module, valid: list, classes: tuple, step: dict, num_blocks: int, num_workers: int) -> dict:
    """The fake steps (at ``depths_for`` per stage) of every (trace key, last stage), grouped by world size and rank
    (one fake world each)."""
    wanted: dict[tuple, Layout] = {}
    for _, cfg, layout in valid:
        key = _trace_key(layout)
        traced = _trace_layout(cfg, layout)
        plain = None
        if key[2] is not None and key[3] is None:  # the optimizer step is traced without checkpointing only: it
            # is the same (a pipeline's stage traces run it: their few keys need no second trace)
            config = copy.deepcopy(cfg)
            config.memory.gc = False
            plain = _trace_layout(config, layout)
        for last in _positions(layout):
            wanted.setdefault((key, last), traced)
            if plain is not None:
                wanted.setdefault((_plain_key(key), last), plain)
    by_world: dict[tuple[int, int], list[tuple]] = {}
    for (key, last), layout in wanted.items():
        by_world.setdefault((layout.dims.world_size, _rank_of(layout, last)), []).append((key, last))
    block = 512 if any(layout.device_type == "cuda" for layout in wanted.values()) else 1
    keys = list(by_world.values())
    groups = []
    for (_, rank), group in zip(by_world, keys, strict=True):
        jobs = []
        for key, last in group:
            layout = dataclasses.replace(wanted[(key, last)], compile=False, offload_params=False)
            depths = depths_for(stage_blocks(layout, num_blocks)[last], key[2] or 1)
            jobs.append((layout, depths, key[2] is None or key[3] is not None, rank))
        groups.append(jobs)
    results = trace_groups(meta, groups, classes, num_workers=num_workers, block_bytes=block, **step)
    return {key: by_depth for group, traced in zip(keys, results, strict=True)
            for key, by_depth in zip(group, traced, strict=True)}  # fmt: skip


def _helds(meta: nn.Module, valid: list, classes: tuple, num_blocks: int) -> dict:
    """The exact held state of every distinct sharded layout (and stage) at the real world size."""
    layouts: dict[tuple[int, bool], dict] = {}
    for _, _, layout in valid:
        if layout.dims.sharded:
            for last in _positions(layout):
                rank = _rank_of(layout, last)
                layouts.setdefault((rank, last), {}).setdefault(
                    layout.dims, dataclasses.replace(layout, compile=False, offload_params=False, checkpointing=None)
                )
    found = {}
    for (rank, last), by_dims in layouts.items():
        held = held_state(meta, list(by_dims.values()), classes, num_blocks=num_blocks, rank=rank, last_stage=last)
        found.update({(dims, last): line for dims, line in zip(by_dims, held, strict=True)})
    return found
