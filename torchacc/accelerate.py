"""``accelerate()``: the one call that turns a plain model and loader into a sharded training setup.

Order of work (each step is one function in its own module):
validate the config, the model, the loader and the optimizer (no collective has run yet, so a
mistake raises the same error on every rank instead of hanging) -> process group and mesh ->
activation checkpointing -> ``fully_shard`` bottom-up then the root (or DDP) -> mixed precision ->
optimizer remap -> the sharded dataloader.
"""

from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.data import DataLoader

from .activation_checkpoint import apply_activation_checkpointing
from .config import Config
from .data import ShardedDataLoader, shard_dataloader
from .dist import env
from .dist.collectives import broadcast_tensors
from .dist.fsdp import is_wrapped, resolve_module_classes, wrap_ddp, wrap_fsdp
from .dist.mesh import build_mesh
from .precision import compute_dtype, install_autocast
from .sharded_state import get_shard_metadata, load_state_dict

__all__ = ["accelerate"]


@dataclass(frozen=True)
class AcceleratedState:
    """What ``accelerate()`` did to a model, kept on it as ``model._torchacc``."""

    device: torch.device
    mesh: DeviceMesh | None
    dp_size: int
    fsdp_size: int
    compute_dtype: torch.dtype | None


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
    config.validate(world_size)
    _check_model(model)
    wrap_classes = resolve_module_classes(model, config.dist.fsdp.wrap_layer_cls, what="dist.fsdp.wrap_layer_cls")
    gc_classes: set[type[nn.Module]] = set()
    if config.memory.gc:
        what = "memory.gc_cls" if config.memory.gc_cls else "dist.fsdp.wrap_layer_cls"
        gc_classes = resolve_module_classes(model, config.memory.gc_cls or config.dist.fsdp.wrap_layer_cls, what=what)
    param_names = _param_names(model, optimizer)
    device = env.device()
    loader = None
    if dataloader is not None:
        loader = shard_dataloader(
            dataloader,
            num_replicas=world_size,
            rank=rank,
            device=device,
            shuffle=config.dataloader.shuffle,
            drop_last=config.dataloader.drop_last,
            seed=config.dataloader.seed,
            prefetch=config.dataloader.prefetch,
            shard=config.dataloader.shard,
        )

    # Everything below may communicate.
    env.init_distributed(timeout=config.dist.timeout)
    if config.memory.gc:
        apply_activation_checkpointing(model, gc_classes, num_layers=config.memory.gc_cnt)
    model.to(device)
    dtype = compute_dtype(bf16=config.compute.bf16, fp16=config.compute.fp16, device=device)
    dp_size, fsdp_size = config.resolved_dp_size(world_size), config.dist.fsdp.size
    mesh = None
    if fsdp_size > 1:
        if config.dist.fsdp.sync_module_states:
            broadcast_tensors(_unique_tensors(model))
        mesh = build_mesh(device_type=device.type, dp_size=dp_size, fsdp_size=fsdp_size, topology=config.dist.topology)
        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        wrap_fsdp(
            model, mesh, wrap_classes, mp_policy=mp_policy, reshard_after_forward=config.dist.fsdp.reshard_after_forward
        )
    elif dp_size > 1:
        wrap_ddp(model, sync_module_states=config.dist.fsdp.sync_module_states)
    if dtype is not None:
        install_autocast(model, device_type=device.type, dtype=dtype)
    if optimizer is not None:
        _remap_optimizer(optimizer, param_names, model)
    if not hasattr(type(model), "device"):
        model.device = device
    # Checkpoint helpers on the instance: TorchAcc scripts call model.get_shard_metadata(), and
    # load_state_dict must also take full (consolidated) and local-shard state dicts.
    model.get_shard_metadata = MethodType(get_shard_metadata, model)
    model.load_state_dict = MethodType(load_state_dict, model)
    model._torchacc = AcceleratedState(device, mesh, dp_size, fsdp_size, dtype)

    if optimizer is not None:
        return model, loader, optimizer
    return model if loader is None else (model, loader)


def _check_types(model: Any, dataloader: Any, config: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, Config):
        raise TypeError(
            f"config must be a torchacc.Config, got {type(config).__name__}; "
            "build one with torchacc.Config() or Config.from_dict/from_yaml/from_cli"
        )
    if dataloader is not None and isinstance(dataloader, ShardedDataLoader):
        raise ValueError("dataloader was already returned by torchacc.accelerate(); pass the original DataLoader")


def _check_model(model: nn.Module) -> None:
    if hasattr(model, "_torchacc") or is_wrapped(model):
        raise ValueError(
            f"{type(model).__name__} is already accelerated (sharded or replicated); call torchacc.accelerate() "
            "once per model, on the plain model"
        )
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(
            f"{type(model).__name__} has {len(meta)} tensor(s) on the meta device (first: {meta[0]}) and torchacc "
            "has no way to materialize them; build the model on the CPU, or load real weights into it, "
            "before torchacc.accelerate()"
        )


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[nn.Parameter, str]:
    """Names of the model's parameters, checking that ``optimizer`` holds only those."""
    names = {param: name for name, param in model.named_parameters()}
    if optimizer is None:
        return names
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    foreign = [p for group in optimizer.param_groups for p in group["params"] if p not in names]
    if foreign:
        raise ValueError(
            f"optimizer holds {len(foreign)} parameter(s) that are not parameters of {type(model).__name__} "
            f"(first has shape {tuple(foreign[0].shape)}); build the optimizer from model.parameters()"
        )
    return names


def _unique_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _remap_optimizer(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str], model: nn.Module) -> None:
    """Point ``optimizer`` at the sharded parameters, sharding any state it already has like them."""
    new_params = dict(model.named_parameters())
    remap = {old: new_params[name] for old, name in names.items()}
    for group in optimizer.param_groups:
        group["params"] = [remap[p] for p in group["params"]]
    for old, state in list(optimizer.state.items()):
        new = remap[old]
        if isinstance(new, DTensor):
            state = {
                key: distribute_tensor(value.to(new.device), new.device_mesh, new.placements, src_data_rank=None)
                if isinstance(value, torch.Tensor) and value.shape == new.shape and value.dim() > 0
                else value
                for key, value in state.items()
            }
        del optimizer.state[old]
        optimizer.state[new] = state
