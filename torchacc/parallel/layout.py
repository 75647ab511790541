"""The layout of one job, resolved once from a ``Config``: what ``accelerate()``, the strategy and the planner do.

[Note: one layout] ``Layout.from_config`` validates the config (the only place that does) and resolves every
setting the engine acts on into plain, frozen values: the parallel sizes and the mesh they make
(``ParallelDims``, TorchTitan's name for it), the FSDP units and their prefetching, the precision, activation
checkpointing, compilation, offloading, initialization, the TP plan and the pipeline schedule. ``accelerate()``,
``FSDP2Strategy`` and the planner build it the same way and hand it to the same engine (``shard_model``), so what
the planner describes is what ``accelerate()`` does. Nothing below the boundary reads the ``Config``.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..config import Config
from ..distributed.mesh import build_mesh, context_parallel_rank, data_parallel_rank

__all__ = ["ActivationCheckpointing", "Layout", "ParallelDims", "PipelineSchedule"]


@dataclass(frozen=True)
class ParallelDims:
    """The parallel sizes of one job and the mesh they make (see [Note: mesh layout] in distributed/mesh.py).

    Example:
        >>> dims = ParallelDims(world_size=8, dp=2, fsdp=2, tp=2)
        >>> dims.num_data_ranks, dims.data_parallel_rank(5)
        (4, 2)
    """

    world_size: int
    dp: int
    """Model replicas (HSDP's replicate axis, or DDP)."""
    fsdp: int
    """Ranks that shard one replica."""
    tp: int = 1
    """Ranks that split each tensor-parallel layer (innermost unless ``topology`` says otherwise)."""
    topology: tuple[str, ...] = ("dp", "fsdp")
    """The order of the axes in the rank layout, outermost first."""
    pp: int = 1
    """Pipeline stages on different ranks (the outermost axis, outside ``topology``)."""
    cp: int = 1
    """Ranks that split each sequence (context parallelism; just outside ``tp`` in the rank layout)."""

    def __post_init__(self) -> None:
        if self.pp * self.dp * self.fsdp * self.tp * self.cp != self.world_size:
            raise AssertionError(f"{self} does not multiply to its world size")

    @property
    def num_data_ranks(self) -> int:
        """Ranks that take different batches: ``dp * fsdp`` (the ranks of one TP or CP group or of one pipeline share
        theirs)."""
        return self.dp * self.fsdp

    @property
    def needs_mesh(self) -> bool:
        """False for plain data parallelism and one process (DDP, or nothing, needs no mesh)."""
        return self.fsdp > 1 or self.tp > 1 or self.pp > 1 or self.cp > 1

    @property
    def sharded(self) -> bool:
        """True when ``fully_shard`` runs: some replica is sharded (FSDP, HSDP; over ``fsdp x cp`` with context
        parallelism), or TP or a pipeline runs beside replicas (which ``fully_shard`` then keeps in sync, with
        shards of one rank)."""
        return self.needs_mesh and self.dp * self.fsdp * self.cp > 1

    def data_parallel_rank(self, rank: int) -> int:
        """``rank``'s index among the ``num_data_ranks`` data-parallel ranks (pure arithmetic)."""
        return data_parallel_rank(
            rank,
            dp_size=self.dp,
            fsdp_size=self.fsdp,
            tp_size=self.tp,
            topology=self.topology,
            pp_size=self.pp,
            cp_size=self.cp,
        )

    def context_parallel_rank(self, rank: int) -> int:
        """``rank``'s index in its CP group (the chunk of each sequence it takes); 0 without context parallelism."""
        if self.cp == 1:
            return 0
        return context_parallel_rank(
            rank,
            dp_size=self.dp,
            fsdp_size=self.fsdp,
            cp_size=self.cp,
            tp_size=self.tp,
            topology=self.topology,
            pp_size=self.pp,
        )

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The job's mesh under the running process group (real or fake), or None when ``needs_mesh`` is False."""
        if not self.needs_mesh:
            return None
        return build_mesh(
            device_type=device_type,
            dp_size=self.dp,
            fsdp_size=self.fsdp,
            tp_size=self.tp,
            topology=self.topology,
            pp_size=self.pp,
            cp_size=self.cp,
        )

    def describe(self) -> str:
        """``"fsdp=2 x tp=2"``-style text, outermost axis first, sizes of 1 left out (``"1 rank"`` alone)."""
        sizes = {"pp": self.pp, "dp": self.dp, "fsdp": self.fsdp, "tp": self.tp, "cp": self.cp}
        order = ["pp", *self.topology, *(["tp"] if "tp" not in self.topology else [])]
        order.insert(order.index("tp"), "cp")
        parts = [f"{axis}={sizes[axis]}" for axis in order if sizes[axis] > 1]
        return " x ".join(parts) or "1 rank"


@dataclass(frozen=True)
class ActivationCheckpointing:
    """Which layers recompute their activations in backward."""

    class_names: frozenset[str]
    """Class names of the checkpointed layers (memory.gc_cls, or the FSDP unit classes)."""
    num_layers: int | None = None
    """Only the first N matching layers; None: all."""
    interval: int = 1
    """Every k-th matching layer."""
    source: str = "memory.gc_cls"
    """The config field the class names came from (named in errors)."""


@dataclass(frozen=True)
class PipelineSchedule:
    """How the stages of a pipeline run (``dist.pp``); the split itself is resolved against the model (plan.py)."""

    schedule: str
    """"1F1B", "GPipe" or "Interleaved1F1B"."""
    num_stages: int
    """All stages of the pipeline: ``dist.pp.size * dist.pp.stages_per_rank``."""
    microbatches: int
    """Microbatches per batch."""
    split: tuple[str, ...] = ()
    """The first block of each stage after the first; empty: the blocks divided evenly."""


@dataclass(frozen=True)
class Layout:
    """Everything the engine does to a model, resolved from a ``Config`` by ``from_config``: see [Note: one layout].

    Example:
        >>> layout = Layout.from_config(config, world_size=8, device_type="cuda")
        >>> layout.dims.describe(), layout.param_dtype
        ('dp=2 x fsdp=4', torch.bfloat16)
    """

    dims: ParallelDims
    device_type: str
    """The device type the layout was resolved for ("cuda", "cpu")."""
    wrap_layer_cls: frozenset[str] = frozenset()
    """Class names of the FSDP units."""
    reshard_after_forward: bool | int = True
    forward_prefetch: int = 0
    backward_prefetch: int = 0
    param_dtype: torch.dtype | None = None
    """The low compute dtype (bf16/fp16), None for float32."""
    reduce_dtype: torch.dtype = torch.float32
    checkpointing: ActivationCheckpointing | None = None
    compile: bool = False
    offload_params: bool = False
    """Effective CPU offload of the shards (CUDA with sharding only; see ``ignored``)."""
    sync_module_states: bool = True
    broadcast_buffers: bool = True
    init_from: str | None = None
    tp_plan: str | Mapping[str, str] = "auto"
    sequence_parallel: bool = False
    pipeline: PipelineSchedule | None = None
    """The pipeline schedule when ``dims.pp > 1``."""
    cp_method: str = "ulysses"
    """How attention sees the whole sequence under context parallelism: "ulysses" or "ring" (dist.cp.method)."""
    ignored: tuple[str, ...] = field(default=())
    """Settings that have no effect in this layout, each with the reason (``accelerate()`` warns once each)."""

    @classmethod
    def from_config(cls, config: Config, *, world_size: int, device_type: str) -> "Layout":
        """Validate ``config`` for ``world_size`` ranks and resolve it; no communication, no model needed.

        Args:
            config: the whole configuration.
            world_size: the number of ranks of the job (the planner passes the GPU count it plans for).
            device_type: "cuda" or "cpu": what the ranks compute on.

        Returns:
            The frozen layout.

        Raises:
            ValueError: from ``config.validate(world_size)``, naming the dotted path.
        """
        config.validate(world_size)
        d, m, c = config.dist, config.memory, config.compute
        tp, pp, cp = d.tp.size, d.pp.size, d.cp.size
        dp = d.dp.size if d.dp.size is not None else world_size // (d.fsdp.size * tp * pp * cp)
        dims = ParallelDims(
            world_size=world_size, dp=dp, fsdp=d.fsdp.size, tp=tp, topology=tuple(d.topology), pp=pp, cp=cp
        )
        if cp > 1 and d.cp.method == "ring" and device_type != "cuda":
            raise ValueError(
                f"dist.cp.method='ring' runs torch's ring attention, which needs CUDA, but this run computes on "
                f"{device_type}; use dist.cp.method='ulysses' (all-to-all, works on any device)"
            )
        ignored = []
        offload = m.offload_params
        if offload and device_type != "cuda":
            ignored.append("memory.offload_params=True is ignored on a CPU run: parameters already live in CPU memory")
            offload = False
        elif offload and not dims.sharded:
            ignored.append("memory.offload_params=True needs FSDP (dist.fsdp.size > 1); it is ignored without sharding")
            offload = False
        checkpointing = None
        if m.gc:
            source = "memory.gc_cls" if m.gc_cls else "dist.fsdp.wrap_layer_cls"
            names = frozenset(m.gc_cls or d.fsdp.wrap_layer_cls)
            checkpointing = ActivationCheckpointing(names, num_layers=m.gc_cnt, interval=m.gc_interval, source=source)
        low = torch.bfloat16 if c.bf16 else torch.float16 if c.fp16 else None
        plan = d.tp.plan if isinstance(d.tp.plan, str) else MappingProxyType(dict(d.tp.plan))
        pipeline = None
        if pp > 1:
            num_stages = pp * d.pp.stages_per_rank
            pipeline = PipelineSchedule(d.pp.schedule, num_stages, d.pp.microbatches or num_stages, tuple(d.pp.split))
        return cls(
            dims=dims,
            device_type=device_type,
            wrap_layer_cls=frozenset(d.fsdp.wrap_layer_cls),
            # a stage runs several microbatches forward before their backwards: regathering for each would multiply
            # the all-gathers, so its parameters stay gathered (TorchTitan's choice too)
            reshard_after_forward=d.fsdp.reshard_after_forward if pp == 1 else False,
            forward_prefetch=d.fsdp.forward_prefetch,
            backward_prefetch=d.fsdp.backward_prefetch,
            param_dtype=low,
            reduce_dtype=getattr(torch, d.fsdp.reduce_dtype),
            checkpointing=checkpointing,
            compile=c.compile,
            offload_params=offload,
            sync_module_states=d.fsdp.sync_module_states,
            broadcast_buffers=d.fsdp.broadcast_buffers,
            init_from=d.fsdp.init_from,
            tp_plan=plan,
            sequence_parallel=d.tp.sequence_parallel,
            pipeline=pipeline,
            cp_method=d.cp.method,
            ignored=tuple(ignored),
        )
