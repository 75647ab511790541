"""The sharding engine behind both ``accelerate()`` and ``FSDP2Strategy``: one code path.

``plan_model`` checks everything about the model without communicating; ``make_mesh`` builds the
device mesh; ``shard_model`` applies activation checkpointing, compilation, sharding (or DDP),
meta-device materialization and mixed precision, in that order; ``remap_optimizer`` moves an
optimizer built too early onto the sharded parameters.
"""

import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._logging import warn_once
from .activation_checkpoint import apply_activation_checkpointing
from .config import Config
from .dist.collectives import broadcast, sync_tensors
from .dist.fsdp import is_wrapped, resolve_module_classes, wrap_ddp, wrap_fsdp
from .dist.mesh import build_mesh
from .materialize import check_materializable, has_meta_params, materialize
from .precision import compute_dtype, install_autocast
from .sharded_state import get_shard_metadata, load_state_dict

__all__ = ["AcceleratedState", "ModelPlan", "plan_model", "make_mesh", "shard_model", "remap_optimizer"]

ParallelizeFn = Callable[[nn.Module, DeviceMesh, MixedPrecisionPolicy], nn.Module | None]


@dataclass(frozen=True)
class AcceleratedState:
    """What the engine did to a model, kept on it as ``model._torchacc``."""

    device: torch.device
    mesh: DeviceMesh | None
    dp_size: int
    fsdp_size: int
    compute_dtype: torch.dtype | None
    run_id: str  # new for each accelerated model, the same on all its ranks; recorded in its shard metadata


@dataclass(frozen=True)
class ModelPlan:
    """The resolved classes and checks for one model; built before any collective."""

    wrap_classes: frozenset[type[nn.Module]]
    gc_classes: frozenset[type[nn.Module]]
    param_names: dict[nn.Parameter, str] = field(hash=False)
    meta: bool


def plan_model(model: nn.Module, config: Config, *, optimizer: torch.optim.Optimizer | None = None) -> ModelPlan:
    """Check ``model`` (and ``optimizer``) against ``config``; no communication.

    Raises:
        ValueError: an already accelerated model, an unknown wrap or checkpoint class (listing the model's
            classes), a meta-device model that cannot be initialized, an optimizer holding other parameters.
        TypeError: ``optimizer`` is not an optimizer.
    """
    if hasattr(model, "_torchacc") or is_wrapped(model):
        raise ValueError(
            f"{type(model).__name__} is already accelerated (sharded or replicated); call torchacc.accelerate() "
            "once per model, on the plain model"
        )
    meta = has_meta_params(model)
    if meta:
        check_materializable(model, config.dist.fsdp.init_from)
    elif any(b.is_meta for b in model.buffers()):
        check_materializable(model, None)
    wrap = resolve_module_classes(model, config.dist.fsdp.wrap_layer_cls, what="dist.fsdp.wrap_layer_cls")
    gc: set[type[nn.Module]] = set()
    if config.memory.gc:
        what = "memory.gc_cls" if config.memory.gc_cls else "dist.fsdp.wrap_layer_cls"
        gc = resolve_module_classes(model, config.memory.gc_cls or config.dist.fsdp.wrap_layer_cls, what=what)
    if config.compute.compile and not wrap:
        raise ValueError("compute.compile=True compiles each dist.fsdp.wrap_layer_cls block; set wrap_layer_cls too")
    names = {param: name for name, param in model.named_parameters()}
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        foreign = [p for group in optimizer.param_groups for p in group["params"] if p not in names]
        if foreign:
            raise ValueError(
                f"optimizer holds {len(foreign)} parameter(s) that are not parameters of {type(model).__name__} "
                f"(first has shape {tuple(foreign[0].shape)}); build the optimizer from model.parameters()"
            )
    return ModelPlan(frozenset(wrap), frozenset(gc), names, meta)


def make_mesh(config: Config, *, world_size: int, device: torch.device) -> DeviceMesh | None:
    """The mesh ``fully_shard`` uses, or None when nothing is sharded (plain DP, or one process)."""
    if config.dist.fsdp.size == 1:
        return None
    dp_size = config.resolved_dp_size(world_size)
    return build_mesh(
        device_type=device.type, dp_size=dp_size, fsdp_size=config.dist.fsdp.size, topology=config.dist.topology
    )


def _compile_blocks(model: nn.Module, classes: frozenset[type[nn.Module]]) -> None:
    # The block's forward is compiled in place (not wrapped in an OptimizedModule): the module's
    # __call__, and so FSDP's pre/post-forward hooks, stay eager, and no "_orig_mod." enters any key.
    hf_config = getattr(model, "config", None)
    if getattr(hf_config, "use_cache", None) is True:
        # Each block updates its own layer's KV-cache entry and dynamo guards on it, so every block
        # recompiles; past torch._dynamo.config.recompile_limit the remaining blocks silently run eager.
        hf_config.use_cache = False
        warn_once(
            "compute.compile=True set model.config.use_cache=False: a KV cache makes every compiled block "
            "recompile during training; set it back to True before calling generate()"
        )
    for module in model.modules():
        if module is not model and isinstance(module, tuple(classes)):
            module.forward = torch.compile(module.forward)


def shard_model(
    model: nn.Module,
    config: Config,
    plan: ModelPlan,
    *,
    mesh: DeviceMesh | None,
    device: torch.device,
    world_size: int,
    parallelize_fn: ParallelizeFn | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Turn ``model`` into an accelerated model, in place. Every rank must call it (it communicates).

    Args:
        model: the plain model (possibly on the meta device, see ``torchacc.init_empty_weights``).
        config: the validated config.
        plan: ``plan_model(model, config)``.
        mesh: ``make_mesh(config, ...)``: FSDP/HSDP when given, DDP or nothing otherwise.
        device: this rank's device.
        world_size: the job's world size.
        parallelize_fn: replaces the class-name wrapping: called as ``fn(model, mesh, mp_policy)``.
        mp_policy: replaces the policy derived from ``config.compute``.

    Returns:
        ``model``, sharded, on ``device``, with ``get_shard_metadata`` and a ``load_state_dict`` that
        accepts full, DTensor and local-shard state dicts.
    """
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if plan.meta else {}
    if config.memory.gc:
        apply_activation_checkpointing(
            model, plan.gc_classes, num_layers=config.memory.gc_cnt, interval=config.memory.gc_interval
        )
    if config.compute.compile:
        _compile_blocks(model, plan.wrap_classes)
    dtype = compute_dtype(bf16=config.compute.bf16, fp16=config.compute.fp16, device=device)
    if mp_policy is not None and mp_policy.param_dtype in (torch.bfloat16, torch.float16):
        dtype = mp_policy.param_dtype
    if not plan.meta:
        model.to(device)
    offload = None
    if config.memory.offload_params:
        if device.type == "cuda" and mesh is not None:
            offload = CPUOffloadPolicy()
        elif device.type == "cuda":
            warn_once("memory.offload_params=True needs FSDP (dist.fsdp.size > 1); it is ignored without sharding")
        else:
            warn_once("memory.offload_params=True is ignored on a CPU run: parameters already live in CPU memory")
    if mesh is not None:
        if config.dist.fsdp.sync_module_states and not plan.meta:
            sync_tensors([*model.parameters(), *model.buffers()])
        reduce_dtype = getattr(torch, config.dist.fsdp.reduce_dtype)
        mp_policy = mp_policy or MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
        if parallelize_fn is not None:
            model = parallelize_fn(model, mesh, mp_policy) or model
        else:
            wrap_fsdp(
                model,
                mesh,
                plan.wrap_classes,
                mp_policy=mp_policy,
                reshard_after_forward=config.dist.fsdp.reshard_after_forward,
                offload_policy=offload,
                forward_prefetch=config.dist.fsdp.forward_prefetch,
                backward_prefetch=config.dist.fsdp.backward_prefetch,
            )
        if plan.meta:
            materialize(model, device=device, buffers=buffers, init_from=config.dist.fsdp.init_from)
        _mark_replaced(plan)
    else:
        if plan.meta:
            materialize(model, device=device, buffers=buffers, init_from=config.dist.fsdp.init_from)
        if world_size > 1:
            wrap_ddp(model, sync_module_states=config.dist.fsdp.sync_module_states)
    if dtype is not None:
        install_autocast(model, device_type=device.type, dtype=dtype)
    if not hasattr(type(model), "device"):
        model.device = device
    # Checkpoint helpers on the instance: TorchAcc scripts call model.get_shard_metadata(), and
    # load_state_dict must also take full (consolidated) and local-shard state dicts.
    model.get_shard_metadata = MethodType(get_shard_metadata, model)
    model.load_state_dict = MethodType(load_state_dict, model)
    dp_size = config.resolved_dp_size(world_size)
    run_id = broadcast(uuid.uuid4().hex)  # every rank draws one; all keep rank 0's
    model._torchacc = AcceleratedState(device, mesh, dp_size, config.dist.fsdp.size, dtype, run_id)
    return model


_checked_optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_hook_installed = False


def _mark_replaced(plan: ModelPlan) -> None:
    """Tag the pre-shard parameters, so an optimizer built on them fails at its first step, not silently."""
    global _hook_installed
    for param, name in plan.param_names.items():
        param._torchacc_replaced = name
    if not _hook_installed:
        register_optimizer_step_pre_hook(_refuse_stale_optimizer)
        _hook_installed = True


def _refuse_stale_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # Under FSDP2 an optimizer built before sharding updates parameters the model no longer uses:
    # the loss never moves and nothing says why (a known PyTorch trap). Checked once per optimizer.
    if optimizer in _checked_optimizers:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = getattr(param, "_torchacc_replaced", None)
            if name is not None:
                raise RuntimeError(
                    f"this optimizer holds parameters that torchacc.accelerate() replaced by sharded ones (first: "
                    f"{name!r}), so it would train nothing; build the optimizer after accelerate() from "
                    "model.parameters(), or pass it in: accelerate(model, loader, config, optimizer=optimizer)"
                )
    _checked_optimizers.add(optimizer)


def remap_optimizer(optimizer: torch.optim.Optimizer, plan: ModelPlan, model: nn.Module) -> None:
    """Point ``optimizer`` at the sharded parameters, sharding any state it already has like them."""
    new_params = dict(model.named_parameters())
    remap = {old: new_params[name] for old, name in plan.param_names.items()}
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
