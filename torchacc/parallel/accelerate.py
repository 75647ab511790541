"""``accelerate()``: the one call that turns a plain model and loader into a sharded training setup.

Order of work: resolve the config into a ``Layout`` (validating it) and check the model, the loader and the
optimizer against it without communicating -> process group -> one meeting of all ranks that compares their
configs and shares any validation error, so that a mistake (even one made on one rank only) raises on every
rank instead of hanging -> mesh -> the engine (activation checkpointing -> compile -> ``fully_shard``
bottom-up then the root, or DDP -> meta-device materialization -> mixed precision) -> optimizer remap. The
engine (``torchacc/parallel/engine.py``) is shared with ``FSDP2Strategy``.
"""

import dataclasses
import os
import sys
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from ..config import Config
from ..data import ShardedDataLoader, shard_dataloader
from ..distributed import env
from ..metrics import install_metrics
from .agree import agree_on_config, report_config_error
from .context import sequence_split
from .engine import remap_optimizer, shard_model
from .layout import Layout
from .plan import plan_model

__all__ = ["accelerate"]


def accelerate(
    model: nn.Module,
    dataloader: DataLoader | None = None,
    config: Config | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Shard ``model`` over the ranks of this job and split ``dataloader`` among them.

    Build the optimizer **after** this call, from the returned model's parameters: under FSDP2 the
    parameters are replaced by sharded DTensors, and an optimizer built on the old ones trains
    nothing. If the optimizer already exists, pass it as ``optimizer=``: its parameters (and any
    state) are moved onto the sharded ones and it is returned as a third element. Call the model as
    ``model(...)``, not ``model.forward(...)``, so the parameter all-gathers run.

    Args:
        model: a plain ``nn.Module`` on the CPU (or already on this rank's device).
        dataloader: an optional map-style ``DataLoader``; it is rebuilt with a ``DistributedSampler``
            over the data-parallel ranks and yields batches already on the device.
        config: a ``torchacc.Config``; defaults to ``Config()`` (plain data parallel, float32).
        optimizer: an optimizer built on ``model`` before this call, to be remapped.

    Returns:
        ``model``; ``(model, dataloader)`` when a dataloader is given; ``(model, dataloader,
        optimizer)`` when an optimizer is given (``dataloader`` may then be None). The model keeps its
        parameter names, lives on ``model.device`` and is called as before.

    Raises:
        ValueError: an invalid config (the message names the dotted path), a wrap or checkpoint class
            the model does not contain, a model that is already accelerated or lives on the meta device,
            or an optimizer holding parameters that are not the model's.
        TypeError: ``model``, ``dataloader`` or ``config`` of the wrong type.

    Example:
        >>> config = torchacc.Config()
        >>> config.compute.bf16 = True
        >>> config.dist.fsdp.size = 2
        >>> config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
        >>> model, loader = torchacc.accelerate(model, loader, config)
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    """
    config = Config() if config is None else config
    _check_types(model, dataloader, config)
    world_size, rank = env.world_size(), env.rank()
    try:
        _require_torchrun(config, world_size)
        device = env.device()
        layout = Layout.from_config(config, world_size=world_size, device_type=device.type)
        plan = plan_model(model, layout, optimizer=optimizer)
        loader = None
        if dataloader is not None:
            # the ranks of one TP or CP group (or pipeline) take the same batches: the sampler runs over the dp x fsdp
            # ranks
            loader = shard_dataloader(
                dataloader,
                num_replicas=layout.dims.num_data_ranks,
                rank=layout.dims.data_parallel_rank(rank),
                device=device,
                shuffle=config.dataloader.shuffle,
                drop_last=config.dataloader.drop_last,
                seed=config.dataloader.seed,
                prefetch=config.dataloader.prefetch,
                shard=config.dataloader.shard,
                transform=sequence_split(layout, rank),  # CP: this rank's chunk of every sequence
            )
    except (ValueError, TypeError) as exc:
        if world_size > 1:
            report_config_error(config, exc)
        raise

    # Everything above only checks; everything below may communicate.
    env.init_distributed(timeout=config.dist.timeout)
    run_id = agree_on_config(config, None)
    mesh = layout.dims.build_mesh(device.type)
    shard_model(model, layout, plan, mesh=mesh, device=device, run_id=run_id)
    install_metrics(model, loader, **dataclasses.asdict(config.metrics))  # metrics.every=0: installs nothing
    if optimizer is not None:
        remap_optimizer(optimizer, model)
        return model, loader, optimizer
    return model if loader is None else (model, loader)


def _require_torchrun(config: Config, world_size: int) -> None:
    """A layout of several ranks run as plain ``python train.py``: say how to launch it."""
    wanted = config.dist.fsdp.size * config.dist.tp.size * config.dist.pp.size * config.dist.cp.size
    wanted *= config.dist.dp.size or 1
    if world_size == 1 and wanted > 1 and "WORLD_SIZE" not in os.environ:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        script = script if script and not script.startswith("-") else "train.py"
        layout = f"dist.fsdp.size={config.dist.fsdp.size}"
        if config.dist.tp.size > 1:
            layout += f" x dist.tp.size={config.dist.tp.size}"
        if config.dist.cp.size > 1:
            layout += f" x dist.cp.size={config.dist.cp.size}"
        if config.dist.pp.size > 1:
            layout = f"dist.pp.size={config.dist.pp.size} x {layout}"
        if config.dist.dp.size:
            layout += f" x dist.dp.size={config.dist.dp.size}"
        raise ValueError(
            f"{layout} asks for {wanted} processes, but this one was not started by torchrun and runs alone; "
            f"launch it with `torchrun --nproc_per_node={wanted} {script}`, or set dist.fsdp.size=1 "
            f"{'and dist.tp.size=1 ' if config.dist.tp.size > 1 else ''}"
            f"{'and dist.pp.size=1 ' if config.dist.pp.size > 1 else ''}"
            f"{'and dist.cp.size=1 ' if config.dist.cp.size > 1 else ''}to train in one process"
        )


def _check_types(model: Any, dataloader: Any, config: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, Config):
        raise TypeError(
            f"config must be a torchacc.Config, got {type(config).__name__}; "
            "build one with torchacc.Config() or Config.from_dict/from_yaml/from_cli"
        )
    if dataloader is not None and not isinstance(dataloader, (DataLoader, ShardedDataLoader)):
        raise TypeError(
            f"dataloader must be a torch.utils.data.DataLoader or None, got {type(dataloader).__name__}; wrap your "
            "dataset: DataLoader(dataset, batch_size=...)"
        )
    if isinstance(dataloader, ShardedDataLoader):
        raise ValueError("dataloader was already returned by torchacc.accelerate(); pass the original DataLoader")
