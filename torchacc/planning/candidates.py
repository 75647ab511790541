"""The layouts the planner tries: a list of candidates, the product of independent axes.

[Note: candidate axes] Each axis is a function ``(Cluster) -> list[Choice]``; a choice is a label and the
config settings (dotted paths) that make it. ``enumerate_candidates`` takes the product of the axes, so a new
independent setting is one more function in ``AXES``, plus its costs in costs.py. The parallel sizes are not
independent of each other: they divide one GPU count (``pp * dp * fsdp * cp * tp = N``), so a pipeline of 4
stages leaves each stage ``N / 4`` GPUs to shard over. They are therefore the choices of one axis,
``layout_axis``: the FSDP / HSDP / TP layouts of ``parallel_axis`` over all GPUs, then the pipelines of
``pipeline_layouts`` and the context-parallel layouts of ``context_layouts``, each choice fixing every size. A
candidate that ``accelerate()`` would refuse is kept, with the refusal, for the table of layouts that cannot
exist.

[Note: which PP and CP layouts] Pipelines: ``pp`` = 2, 4 ... ``max_pp`` (4) stages, over nodes (``pp``
divides the number of nodes, so a stage is one node or more and the stage boundaries cross nodes; on one node,
stages within it), ``dist.pp.microbatches`` the default (one per stage, the fewest 1F1B takes), schedule 1F1B,
FSDP over each stage's GPUs, and activation checkpointing of every block: the first stage holds the activations
of ``pp`` microbatches at once, so a pipeline that fits without checkpointing is one whose unpipelined layouts
fit too, and each pipeline the planner traces costs its stages' fake steps (a ``plan_layouts(axes=...)`` call
can try the others). Context parallelism: ``cp`` = 2, 4 ... up to a node (a CP group exchanges every
layer's attention inputs, so it stays on NVLink), FSDP over the rest, and only for sequences of at least
``CP_MIN_SEQ_LEN`` tokens (``worth_trying``): below that, checkpointing keeps one sequence's activations small
next to the sharded state, and CP only adds its all-to-alls to the same work per token.
"""

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import Config

__all__ = [
    "AXES",
    "CP_MIN_SEQ_LEN",
    "Candidate",
    "Choice",
    "Cluster",
    "context_layouts",
    "enumerate_candidates",
    "layout_axis",
    "parallel_axis",
    "pipeline_layouts",
    "worth_trying",
]

CP_MIN_SEQ_LEN = 16384
"""Context-parallel layouts are tried for sequences at least this long (see [Note: which PP and CP layouts])."""


@dataclass(frozen=True)
class Cluster:
    """What the planner plans for."""

    num_gpus: int
    gpus_per_node: int = 8
    ac_interval: int = 2
    """The k of "activation checkpointing of 1 block in k"."""
    max_pp: int = 4
    """The most pipeline stages tried (each pipeline size costs the planner fake steps of its stages)."""

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


def _inside_node(node: int) -> list[int]:
    """Group sizes (powers of two) that tile a node: no TP or CP group then spans two nodes."""
    return [size for size in _powers_of_two(node) if node % size == 0]


def parallel_axis(cluster: Cluster) -> list[Choice]:
    """FSDP over all GPUs; HSDP with a shard group of 1, 2, 4 ... nodes; FSDP x TP with TP inside a node."""
    n, node = cluster.num_gpus, cluster.node_size
    flat = {"dist.pp.size": 1, "dist.cp.size": 1}
    choices = [Choice(f"fsdp={n}", {"dist.fsdp.size": n, "dist.dp.size": None, "dist.tp.size": 1, **flat})]
    shard = max(node, 2)  # replicas of one GPU each would be plain DDP, which is not a candidate
    while shard < n:
        choices.append(Choice(f"dp={n // shard} x fsdp={shard}" if n % shard == 0 else f"hsdp fsdp={shard}",
                              {"dist.fsdp.size": shard, "dist.dp.size": None, "dist.tp.size": 1, **flat}))  # fmt: skip
        shard *= 2
    for tp in _inside_node(node):
        fsdp = n // tp  # tp divides the node, and the node the GPUs
        label = f"fsdp={fsdp} x tp={tp}" if fsdp > 1 else f"tp={tp}"
        choices.append(Choice(label, {"dist.fsdp.size": fsdp, "dist.dp.size": None, "dist.tp.size": tp, **flat}))
    return choices


def pipeline_layouts(cluster: Cluster) -> list[Choice]:
    """Pipelines of 2, 4 ... ``max_pp`` stages over nodes, FSDP over each stage's GPUs; see [Note: which PP and CP
    layouts]."""
    n, node = cluster.num_gpus, cluster.node_size
    nodes = n // node
    choices = []
    for pp in _powers_of_two(min(cluster.max_pp, nodes if nodes > 1 else n)):
        if n % pp or (nodes > 1 and nodes % pp):  # over nodes, a stage is whole nodes
            continue
        fsdp = n // pp
        label = f"pp={pp} x fsdp={fsdp}" if fsdp > 1 else f"pp={pp}"
        choices.append(Choice(label, {"dist.pp.size": pp, "dist.fsdp.size": fsdp, "dist.dp.size": None,
                                      "dist.tp.size": 1, "dist.cp.size": 1, "dist.pp.schedule": "1F1B",
                                      "dist.pp.stages_per_rank": 1, "dist.pp.microbatches": None}))  # fmt: skip
    return choices


def context_layouts(cluster: Cluster) -> list[Choice]:
    """Context parallelism (Ulysses) of 2, 4 ... ranks inside a node, FSDP over the rest; see [Note: which PP and
    CP layouts]."""
    n, node = cluster.num_gpus, cluster.node_size
    choices = []
    for cp in _inside_node(node):
        fsdp = n // cp
        label = f"fsdp={fsdp} x cp={cp}" if fsdp > 1 else f"cp={cp}"
        choices.append(Choice(label, {"dist.cp.size": cp, "dist.fsdp.size": fsdp, "dist.dp.size": None,
                                      "dist.tp.size": 1, "dist.pp.size": 1}))  # fmt: skip
    return choices


def layout_axis(cluster: Cluster) -> list[Choice]:
    """Every parallel layout: ``parallel_axis``, ``pipeline_layouts``, ``context_layouts`` (see [Note: candidate
    axes])."""
    return parallel_axis(cluster) + pipeline_layouts(cluster) + context_layouts(cluster)


def worth_trying(candidate: Candidate, *, seq_len: int) -> bool:
    """False for a context-parallel candidate on sequences shorter than ``CP_MIN_SEQ_LEN``, and for a pipeline
    without activation checkpointing of every block (see [Note: which PP and CP layouts])."""
    settings = candidate.settings
    if settings.get("dist.pp.size", 1) > 1 and not (
        settings.get("memory.gc") and settings.get("memory.gc_interval") == 1
    ):
        return False
    return settings.get("dist.cp.size", 1) == 1 or seq_len >= CP_MIN_SEQ_LEN


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


AXES: list[Callable[[Cluster], list[Choice]]] = [layout_axis, checkpointing_axis, offload_axis]
"""The axes, outermost first; append a function to add one (see [Note: candidate axes])."""


def enumerate_candidates(
    cluster: Cluster, *, axes: Sequence[Callable[[Cluster], list[Choice]]] = tuple(AXES)
) -> list[Candidate]:
    """Every combination of one choice per axis, in axis order."""
    candidates = [Candidate(())]
    for axis in axes:
        candidates = [Candidate((*c.choices, choice)) for c in candidates for choice in axis(cluster)]
    return candidates
