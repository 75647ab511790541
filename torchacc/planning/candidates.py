"""The layouts the planner tries: a list of candidates, the product of independent axes.

[Note: candidate axes] Each axis is a function ``(Cluster) -> list[Choice]``; a choice is a label and the
config settings (dotted paths) that make it. ``enumerate_candidates`` takes the product of the axes, so a new
kind of parallelism is one more function in ``AXES`` (e.g. pipeline stages: ``[Choice("pp=4",
{"dist.pp.size": 4}), ...]``) plus its costs in costs.py; nothing else changes. A candidate that
``accelerate()`` would refuse is kept, with the refusal, for the table of layouts that cannot exist.
"""

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import Config

__all__ = ["AXES", "Candidate", "Choice", "Cluster", "enumerate_candidates", "parallel_axis"]


@dataclass(frozen=True)
class Cluster:
    """What the planner plans for."""

    num_gpus: int
    gpus_per_node: int = 8
    ac_interval: int = 2
    """The k of "activation checkpointing of 1 block in k"."""

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"--gpus and --gpus-per-node must be >= 1, got {self.num_gpus} and {self.gpus_per_node}")
        n, node = self.num_gpus, self.gpus_per_node
        if n > node and n % node:
            raise ValueError(
                f"--gpus {n} is not a whole number of nodes of --gpus-per-node {node}; use a multiple of {node} "
                f"(e.g. {n // node * node} or {(n // node + 1) * node}), or set --gpus-per-node"
            )
        if self.ac_interval < 2:
            raise ValueError(
                f"--ac-interval must be >= 2 (1 is every block, which is tried anyway), got {self.ac_interval}"
            )

    @property
    def node_size(self) -> int:
        """GPUs per node, or all of them when they fit in one node."""
        return min(self.num_gpus, self.gpus_per_node)


@dataclass(frozen=True)
class Choice:
    """One value of one axis: a label for the table and the config settings it stands for."""

    label: str
    settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    """One layout: the choices of every axis, and the config they make from a base config."""

    choices: tuple[Choice, ...]

    @property
    def label(self) -> str:
        return ", ".join(choice.label for choice in self.choices if choice.label)

    @property
    def settings(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for choice in self.choices:
            merged.update(choice.settings)
        return merged

    def config(self, base: Config) -> Config:
        """A copy of ``base`` with this candidate's settings."""
        config = copy.deepcopy(base)
        for dotted, value in self.settings.items():
            *path, leaf = dotted.split(".")
            node = config
            for part in path:
                node = getattr(node, part)
            setattr(node, leaf, value)
        return config


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(1, limit.bit_length()) if 2**i <= limit]


def parallel_axis(cluster: Cluster) -> list[Choice]:
    """FSDP over all GPUs; HSDP with a shard group of 1, 2, 4 ... nodes; FSDP x TP with TP inside a node."""
    n, node = cluster.num_gpus, cluster.node_size
    choices = [Choice(f"fsdp={n}", {"dist.fsdp.size": n, "dist.dp.size": None, "dist.tp.size": 1})]
    shard = node
    while shard < n:
        choices.append(Choice(f"dp={n // shard} x fsdp={shard}" if n % shard == 0 else f"hsdp fsdp={shard}",
                              {"dist.fsdp.size": shard, "dist.dp.size": None, "dist.tp.size": 1}))  # fmt: skip
        shard *= 2
    for tp in _powers_of_two(node):
        fsdp = n // tp if n % tp == 0 else max(1, n // tp)
        label = f"fsdp={fsdp} x tp={tp}" if fsdp > 1 else f"tp={tp}"
        choices.append(Choice(label, {"dist.fsdp.size": fsdp, "dist.dp.size": None, "dist.tp.size": tp}))
    return choices


def checkpointing_axis(cluster: Cluster) -> list[Choice]:
    """Activation checkpointing: none, every block, 1 block in ``ac_interval``."""
    k = cluster.ac_interval
    return [
        Choice("", {"memory.gc": False, "memory.gc_interval": 1}),
        Choice("AC every block", {"memory.gc": True, "memory.gc_interval": 1}),
        Choice(f"AC 1 in {k}", {"memory.gc": True, "memory.gc_interval": k}),
    ]


def offload_axis(cluster: Cluster) -> list[Choice]:
    """CPU offload of the sharded state: off, on."""
    return [Choice("", {"memory.offload_params": False}), Choice("CPU offload", {"memory.offload_params": True})]


AXES: list[Callable[[Cluster], list[Choice]]] = [parallel_axis, checkpointing_axis, offload_axis]
"""The axes, outermost first; append a function to add one (see [Note: candidate axes])."""


def enumerate_candidates(
    cluster: Cluster, *, axes: Sequence[Callable[[Cluster], list[Choice]]] = tuple(AXES)
) -> list[Candidate]:
    """Every combination of one choice per axis, in axis order."""
    candidates = [Candidate(())]
    for axis in axes:
        candidates = [Candidate((*c.choices, choice)) for c in candidates for choice in axis(cluster)]
    return candidates
