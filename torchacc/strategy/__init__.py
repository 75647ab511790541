"""``FSDP2Strategy``: the step-by-step API for frameworks and custom trainers.

It is a thin shell over the functions ``accelerate()`` uses (``torchacc/parallel/engine.py`` for the
model, ``shard_dataloader`` for data, ``clip_grad_norm_``, the checkpoint modules): one code path. This
module holds the constructor and the setup (environment, model, data); the rest is split by concept:

* options: checked and written into the ``Config`` by ``options.py``;
* device, mesh, ranks and collectives: ``StrategyRuntimeMixin`` (``runtime.py``);
* steps (forward, backward, optimizer step, accumulation): ``StrategyStepsMixin`` (``steps.py``);
* checkpoints: ``StrategyCheckpointMixin`` (``checkpoint.py``);
* optimizer state out of GPU memory and back: ``StrategyOffloadMixin`` (``offload.py``).
"""

import contextlib
import copy
import dataclasses
import random
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from .._utils.logging import warn_once
from ..config import Config
from ..data import ShardedDataLoader, shard_dataloader
from ..distributed import env
from ..distributed.mesh import build_mesh
from ..metrics import install_metrics, watch_loader
from ..parallel.agree import agree_on_config, report_config_error
from ..parallel.context import sequence_split
from ..parallel.engine import shard_model
from ..parallel.layout import Layout
from ..parallel.meta_init import init_empty_weights
from ..parallel.plan import plan_model
from ..parallel.precision import GradScaler
from .checkpoint import StrategyCheckpointMixin
from .offload import StrategyOffloadMixin
from .options import apply_options, check_options, check_pipeline_options
from .runtime import StrategyRuntimeMixin
from .steps import StrategyStepsMixin

__all__ = ["FSDP2Strategy"]


class FSDP2Strategy(StrategyRuntimeMixin, StrategyStepsMixin, StrategyCheckpointMixin, StrategyOffloadMixin):
    """Drive FSDP2 training step by step: set up, parallelize, then train with explicit step calls.

    Args:
        config: a ``torchacc.Config``; the keyword arguments below override it.
        data_parallel_size: ``"auto"`` or the number of data-parallel ranks, ``world size / tensor_parallel_size``
            (the ranks of one TP group take the same batches; the sharding strategy lays out these ranks).
        tensor_parallel_size: ranks that split each tensor-parallel layer (``config.dist.tp.size``); ``"auto"``
            keeps ``config``'s (1 without a config). Must divide the world size.
        tensor_parallel_plan: ``"auto"`` (the Hugging Face model's own plan, or ``config.dist.tp.plan``) or a
            mapping of module-name patterns to styles, as ``config.dist.tp.plan``.
        sequence_parallel: also split the activations between TP layers along the sequence
            (``config.dist.tp.sequence_parallel``).
        sharding_strategy: ``"FULL_SHARD"`` (reshard after forward), ``"SHARD_GRAD_OP"`` (keep parameters
            gathered between forward and backward), ``"NO_SHARD"`` (DDP), ``"HYBRID_SHARD"`` (shard inside a
            node, replicate across nodes); None keeps ``config``'s layout (FULL_SHARD without a config).
        mp_policy: a ``MixedPrecisionPolicy``, or ``"bf16"`` / ``"fp16"`` / ``"fp32"``; None keeps ``config.compute``.
            With fp16 the strategy scales the loss with a ``GradScaler`` (``strategy.scaler``): ``backward``
            scales, ``optimizer_step`` unscales before clipping and skips steps with inf/NaN gradients.
        cpu_offload: keep shards and optimizer state in CPU memory (CUDA runs; ignored with a warning on CPU).
        activation_checkpointing_policy: class names (or classes) of the layers to checkpoint.
        parallelize_fn: ``fn(model, device_mesh, mp_policy)`` replacing the class-name wrapping, DDP and the TP
            plan; it is always called, with the full mesh (a ``"tp"`` axis under tensor parallelism). Where
            torchacc itself needs no mesh the fn gets one whose ``"fsdp"`` axis has a single rank, so that
            ``fully_shard(module, mesh=device_mesh)`` replicates: ``("dp", "fsdp")`` of shape ``(world size, 1)``
            for NO_SHARD, ``("fsdp",)`` of one rank in a one-process run (which then starts a process group of
            its own process, as a ``DeviceMesh`` needs one).
        checkpoint_io: an object with ``save_checkpoint(checkpoint, path)``, ``load_checkpoint(path)`` and
            ``remove_checkpoint(path)`` that replaces the default file handling.
        state_dict_type: ``"full"`` (one file, written by rank 0) or ``"sharded"`` (a DCP directory).
        seed: seeds Python, NumPy and torch on every rank in ``setup_environment``.
        max_norm: clip gradients to this global norm in ``optimizer_step`` (0 disables clipping).
        micro_train_batch_size: samples per rank per forward.
        train_batch_size: samples per optimizer step over all ranks; the accumulation steps are
            ``train_batch_size // (micro_train_batch_size * data-parallel world size)``. None: no accumulation
            (``micro_train_batch_size`` times the data-parallel world size).
        loss_fn: ``fn(model, batch) -> loss``; default ``model(**batch).loss`` (Hugging Face models).
        defer_replica_all_reduce: with HYBRID_SHARD, reduce-scatter every micro-step but all-reduce across
            replicas only on the last one (less communication, gradients held a little longer).

    Raises:
        ValueError: an unknown sharding strategy or state dict type, a tensor parallel size below 1, sizes
            that do not divide the world size or batch sizes that do not divide (at ``setup_environment``), a
            negative ``max_norm``.

    Example:
        >>> strategy = torchacc.FSDP2Strategy(train_batch_size=16, micro_train_batch_size=2, max_norm=1.0)
        >>> strategy.setup_environment()
        >>> with strategy.init_model_context():
        ...     model = AutoModelForCausalLM.from_config(cfg)
        >>> model = strategy.parallelize(model)
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        tensor_parallel_plan: str | Mapping[str, str] = "auto",
        sequence_parallel: bool = False,
        sharding_strategy: str | None = None,
        mp_policy: MixedPrecisionPolicy | str | None = None,
        cpu_offload: bool = False,
        activation_checkpointing_policy: Any = None,
        parallelize_fn: Callable[..., Any] | None = None,
        checkpoint_io: Any = None,
        state_dict_type: str = "full",
        seed: int = 42,
        max_norm: float = 0.0,
        micro_train_batch_size: int = 1,
        train_batch_size: int | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        defer_replica_all_reduce: bool = False,
    ) -> None:
        check_options(
            config=config,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            tensor_parallel_plan=tensor_parallel_plan,
            sharding_strategy=sharding_strategy,
            mp_policy=mp_policy,
            state_dict_type=state_dict_type,
            max_norm=max_norm,
            micro_train_batch_size=micro_train_batch_size,
            train_batch_size=train_batch_size,
        )
        self.config = copy.deepcopy(config) if config is not None else Config()
        self.data_parallel_size = data_parallel_size  # resolved to an int by setup_environment
        self.tensor_parallel_size = tensor_parallel_size  # likewise
        self.tensor_parallel_plan = tensor_parallel_plan
        self.sequence_parallel = sequence_parallel
        self.sharding_strategy = sharding_strategy or ("FULL_SHARD" if config is None else None)
        self.mp_policy = mp_policy
        self.cpu_offload = cpu_offload
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self.parallelize_fn = parallelize_fn
        self.checkpoint_io = checkpoint_io
        self.state_dict_type = state_dict_type
        self.seed = seed
        self.max_norm = max_norm
        self.micro_train_batch_size = micro_train_batch_size
        self.train_batch_size = train_batch_size
        self.loss_fn = loss_fn
        self.defer_replica_all_reduce = defer_replica_all_reduce
        self.model: nn.Module | None = None
        self.dataloader: ShardedDataLoader | None = None
        self.global_step = 0
        self.scaler: GradScaler | None = None  # set up for fp16 compute in setup_environment
        self._micro_step = 0
        self._backward_done = False  # set by a pipeline's training_step, which runs the backward too
        self._pending_optimizer_state: Any = None
        self._env: dict[str, Any] | None = None

    # --- environment ---------------------------------------------------------------------------

    def setup_environment(self) -> None:
        """Start the process group, seed every RNG, and build the device mesh. Call it first, on every rank.

        Raises:
            ValueError: an invalid layout or batch sizes (the same message on every rank).
        """
        world = env.world_size()
        try:
            apply_options(
                self.config,
                world_size=world,
                data_parallel_size=self.data_parallel_size,
                tensor_parallel_size=self.tensor_parallel_size,
                tensor_parallel_plan=self.tensor_parallel_plan,
                sequence_parallel=self.sequence_parallel,
                sharding_strategy=self.sharding_strategy,
                mp_policy=self.mp_policy,
                cpu_offload=self.cpu_offload,
                activation_checkpointing_policy=self.activation_checkpointing_policy,
            )
            device = env.device()
            layout = Layout.from_config(self.config, world_size=world, device_type=device.type)
            data_ranks = layout.dims.num_data_ranks
            per_step = self.micro_train_batch_size * data_ranks
            if self.train_batch_size is None:
                self.train_batch_size = per_step
            if layout.pipeline is not None:
                check_pipeline_options(
                    loss_fn=self.loss_fn,
                    parallelize_fn=self.parallelize_fn,
                    micro_train_batch_size=self.micro_train_batch_size,
                    microbatches=layout.pipeline.microbatches,
                )
            if self.train_batch_size % per_step:
                raise ValueError(
                    f"train_batch_size={self.train_batch_size} is not a multiple of micro_train_batch_size="
                    f"{self.micro_train_batch_size} x data-parallel world size {data_ranks} = {per_step}; choose a "
                    "multiple"
                )
        except ValueError as exc:
            if world > 1:
                report_config_error(self.config, exc)
            raise
        needs_mesh = self.parallelize_fn is not None
        env.init_distributed(timeout=self.config.dist.timeout, world_of_one=needs_mesh)
        agree_on_config(self.config, None)
        random.seed(self.seed)
        torch.manual_seed(self.seed)
        with contextlib.suppress(ImportError):
            import numpy

            numpy.random.seed(self.seed)
        mesh = layout.dims.build_mesh(device.type)
        if mesh is None and needs_mesh:  # see parallelize_fn above: a mesh that shards over one rank
            mesh = build_mesh(device_type=device.type, dp_size=layout.dims.dp, fsdp_size=1)
        self._env = {"device": device, "mesh": mesh, "layout": layout}
        policy_fp16 = isinstance(self.mp_policy, MixedPrecisionPolicy) and self.mp_policy.param_dtype == torch.float16
        if self.config.compute.fp16 or policy_fp16:
            self.scaler = GradScaler(device)
        self.accumulation_steps = self.train_batch_size // per_step
        self.data_parallel_size, self.tensor_parallel_size = data_ranks, layout.dims.tp

    # --- model -----------------------------------------------------------------------------------

    def init_model_context(self, meta_init: bool = True) -> contextlib.AbstractContextManager:
        """Build the model inside this block: on the meta device when ``meta_init`` (the default: no memory
        until ``parallelize`` allocates only this rank's shards; buffers stay real), normally otherwise."""
        return init_empty_weights() if meta_init else contextlib.nullcontext()

    def tensor_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Lightning's spelling of ``init_model_context(meta_init=bool(empty_init))``."""
        return self.init_model_context(meta_init=bool(empty_init))

    def model_sharded_context(self) -> contextlib.AbstractContextManager:
        """Lightning's spelling of ``init_model_context()``."""
        return self.init_model_context()

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` (once) and keep it for the step methods; a second call warns and returns it.

        A model built in ``init_model_context()`` is materialized shard by shard on this rank's
        device and initialized with its own init (or from ``config.dist.fsdp.init_from``).
        """
        state = self._ready()
        if self.model is not None:
            warn_once("FSDP2Strategy.parallelize() called again: the model is already parallelized; returning it")
            return self.model
        try:
            plan = plan_model(model, state["layout"])
        except (ValueError, TypeError) as exc:
            agree_on_config(self.config, exc)  # a model error on one rank only reaches the others
            raise
        agree_on_config(self.config, None)  # also catches a config changed on some ranks after setup_environment
        policy = self.mp_policy if isinstance(self.mp_policy, MixedPrecisionPolicy) else None
        shard_model(
            model,
            state["layout"],
            plan,
            mesh=state["mesh"],
            device=state["device"],
            parallelize_fn=self.parallelize_fn,
            mp_policy=policy,
        )
        install_metrics(model, self.dataloader, **dataclasses.asdict(self.config.metrics))
        self.model = model
        return model

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("no model yet: call strategy.parallelize(model) first")
        return self.model

    def process_dataloader(self, dataloader: torch.utils.data.DataLoader) -> ShardedDataLoader:
        """Split ``dataloader`` over the data-parallel ranks and deliver batches on the device."""
        state = self._ready()
        cfg = self.config.dataloader
        self.dataloader = shard_dataloader(
            dataloader,
            **self.distributed_sampler_kwargs,  # the ranks of one TP group take the same batches
            device=state["device"],
            shuffle=cfg.shuffle,
            drop_last=cfg.drop_last,
            seed=cfg.seed,
            prefetch=cfg.prefetch,
            shard=cfg.shard,
            transform=sequence_split(state["layout"], env.rank()),  # CP: this rank's chunk of every sequence
        )
        watch_loader(self.dataloader, self.model)
        return self.dataloader
