"""Where an ``FSDP2Strategy`` runs: this rank's device, the mesh, the ranks, and the collectives.

Read-only after ``setup_environment``; every property raises ``RuntimeError`` before it.
"""

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..checkpoint.writing import wait_for_save
from ..distributed import collectives, env

__all__ = ["StrategyRuntimeMixin"]


class StrategyRuntimeMixin:
    """The runtime properties and collectives of ``FSDP2Strategy``."""

    _env: dict[str, Any] | None
    config: Any

    def _ready(self) -> dict[str, Any]:
        if self._env is None:
            raise RuntimeError("the strategy is not set up yet: call strategy.setup_environment() first")
        return self._env

    @property
    def root_device(self) -> torch.device:
        """This rank's device."""
        return self._ready()["device"]

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The whole mesh: ``("fsdp",)`` or ``("dp", "fsdp")``, ``("dp", "fsdp", "tp")`` with tensor parallelism,
        with ``"pp"`` first under pipeline parallelism and a ``"cp"`` axis before ``"tp"`` with context parallelism;
        None for NO_SHARD without TP and single-process runs, unless a ``parallelize_fn`` was given (it then gets a
        mesh whose "fsdp" axis has one rank)."""
        return self._ready()["mesh"]

    @property
    def data_parallel_world_size(self) -> int:
        """Number of data-parallel ranks, ``world_size / (tensor_parallel_size * config.dist.pp.size *
        config.dist.cp.size)`` (dp x fsdp): the ranks that take different batches."""
        return self._ready()["layout"].dims.num_data_ranks

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the data-parallel ranks; the ranks of one TP or CP group or pipeline share it."""
        return self._ready()["layout"].dims.data_parallel_rank(env.rank())

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` for a ``DistributedSampler`` (Lightning's name): the data-parallel ones."""
        return {"num_replicas": self.data_parallel_world_size, "rank": self.data_parallel_rank}

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        self._ready()
        return env.world_size()

    @property
    def global_rank(self) -> int:
        """This process's rank in the job."""
        self._ready()
        return env.rank()

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        self._ready()
        return env.local_rank()

    @property
    def is_global_zero(self) -> bool:
        """True on global rank 0."""
        return self.global_rank == 0

    # --- collectives -----------------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (a named rendezvous when ``name`` is given)."""
        if name is None:
            collectives.barrier()
        else:
            collectives.rendezvous(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank."""
        return collectives.broadcast(obj, src=src)

    def reduce(self, tensor: torch.Tensor | float, reduce_op: str = "mean") -> torch.Tensor | float:
        """All-reduce a copy of ``tensor`` (or a number) with ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``."""
        return collectives.reduce(tensor, op=reduce_op)

    def teardown(self) -> None:
        """Publish a save still in flight (``save_ckpt(blocking=False)``), then destroy the process group."""
        wait_for_save()
        env.teardown()
