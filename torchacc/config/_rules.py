"""The rules of the newer config sections (``dist.pp``, ``metrics``), applied by ``Config.validate``."""

import importlib.util
import math
import sys

from ._io import fmt
from .sections import SINKS as _SINKS
from .sections import DistConfig, MetricsConfig

__all__ = ["PP_SCHEDULES", "validate_pp", "validate_metrics"]

PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


def validate_pp(d: DistConfig) -> None:
    """The rules of ``dist.pp`` (see ``PPConfig``): a known schedule, its stages per rank, enough microbatches."""
    pp = d.pp
    if pp.size == 1:
        for name, unset in (("split", []), ("microbatches", None), ("stages_per_rank", 1)):
            if getattr(pp, name) != unset:
                raise ValueError(
                    f"dist.pp.{name}={fmt(getattr(pp, name))} is set but dist.pp.size is 1 (no pipeline); set "
                    f"dist.pp.size to the number of pipeline ranks, or unset dist.pp.{name}"
                )
    if pp.schedule not in PP_SCHEDULES:
        raise ValueError(f"dist.pp.schedule={pp.schedule!r} is not supported; use one of {', '.join(PP_SCHEDULES)}")
    interleaved = pp.schedule == "Interleaved1F1B"
    if interleaved and pp.stages_per_rank < 2:
        raise ValueError(
            f"dist.pp.schedule='Interleaved1F1B' needs dist.pp.stages_per_rank >= 2, got {pp.stages_per_rank}; set it "
            "to 2 (or more), or use dist.pp.schedule='1F1B' for one stage per rank"
        )
    if not interleaved and pp.stages_per_rank != 1:
        raise ValueError(
            f"dist.pp.stages_per_rank={pp.stages_per_rank} needs dist.pp.schedule='Interleaved1F1B' (the "
            f"{pp.schedule!r} schedule runs one stage per rank); set the schedule, or dist.pp.stages_per_rank=1"
        )
    num_stages = pp.size * pp.stages_per_rank
    micro = pp.microbatches
    if micro is not None and micro < 1:
        raise ValueError(f"dist.pp.microbatches must be None or >= 1, got {micro}; None uses one per stage")
    if micro is not None and pp.size > 1 and pp.schedule != "GPipe" and micro < num_stages:
        raise ValueError(
            f"dist.pp.schedule={pp.schedule!r} needs at least one microbatch per stage: dist.pp.microbatches={micro} "
            f"is fewer than the {num_stages} stages; set dist.pp.microbatches >= {num_stages} (and dividing the "
            "batch size), or use dist.pp.schedule='GPipe'"
        )
    if micro is not None and interleaved and micro % max(1, micro // pp.size):
        rounds = max(1, micro // pp.size)
        raise ValueError(
            f"dist.pp.schedule='Interleaved1F1B' runs microbatches in rounds of dist.pp.size={pp.size}: "
            f"dist.pp.microbatches={micro} is not a multiple of its {rounds} rounds; use a multiple of {pp.size}"
        )
    if pp.split and len(pp.split) != num_stages - 1:
        raise ValueError(
            f"dist.pp.split names {len(pp.split)} block(s) but {num_stages} stages need {num_stages - 1} (the first "
            f"block of each stage after the first), e.g. dist.pp.split=['model.layers.8'] for 2 stages; or leave it "
            "empty to divide the blocks evenly"
        )
    if len(set(pp.split)) != len(pp.split):
        raise ValueError(f"dist.pp.split={pp.split!r} names a block twice; name each stage's first block once")
    if pp.size > 1 and d.tp.sequence_parallel:
        raise ValueError(
            "dist.tp.sequence_parallel=True does not combine with dist.pp.size > 1 (the stages pass whole sequences); "
            "set dist.tp.sequence_parallel=False, or dist.pp.size=1"
        )


# The package each sink needs, and the extra that installs it.
_SINK_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def _installed(package: str) -> bool:
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def validate_metrics(m: MetricsConfig) -> None:
    """The metrics rules; a sink whose package is missing fails here, not at the first record."""
    if m.every < 0:
        raise ValueError(f"metrics.every must be >= 0, got {m.every}; use 0 to turn metrics off, or e.g. 10")
    unknown = sorted(m.sinks - set(_SINKS))
    if unknown:
        raise ValueError(
            f"metrics.sinks={fmt(m.sinks)} holds unknown sink(s) {', '.join(map(repr, unknown))}; use any of "
            f"{', '.join(_SINKS)}"
        )
    if m.peak_flops is not None and not (math.isfinite(m.peak_flops) and m.peak_flops > 0):
        raise ValueError(
            f"metrics.peak_flops must be None or a positive number of FLOP/s per device, got {m.peak_flops}; "
            "e.g. 989e12 for an H100 SXM in bf16, or None to take it from the device name"
        )
    if not m.dir:
        raise ValueError("metrics.dir must name a directory, got ''; e.g. 'runs'")
    if m.run_name is not None and (not m.run_name or "/" in m.run_name or "\\" in m.run_name):
        raise ValueError(
            f"metrics.run_name={m.run_name!r} must be a non-empty name without path separators (it names a "
            "directory); e.g. 'gpt2-fsdp2', or None for one made from the start time"
        )
    if m.every == 0:
        return
    for sink in sorted(m.sinks & set(_SINK_PACKAGES)):
        package, extra = _SINK_PACKAGES[sink]
        if not _installed(package):
            raise ValueError(
                f"metrics.sinks includes {sink!r}, but the {package} package is not installed; install it with "
                f"pip install 'torchacc[{extra}]', or remove {sink!r} from metrics.sinks"
            )
