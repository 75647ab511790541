"""The sharding engine behind both ``accelerate()`` and ``FSDP2Strategy``: one code path.

After ``plan.py`` has checked the model and built the mesh, ``shard_model`` applies activation
checkpointing, compilation, sharding (or DDP), meta-device materialization and mixed precision, in that
order; ``remap_optimizer`` moves an optimizer built too early onto the sharded parameters.

[Note: shard before moving] Under FSDP the model is not moved to the device as a whole: a 70B model
would not fit on one GPU, and CPU offload would be defeated. ``fully_shard`` moves each unit's
parameters to the mesh's device as it shards it (bottom-up, one unit at a time), as TorchTitan relies on.
"""

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from .._utils.logging import warn_once
from ..checkpoint.optimizer import attach_load_hook, shard_like, watch_optimizers
from ..checkpoint.state import get_shard_metadata, load_state_dict
from ..config import Config
from ..distributed.collectives import broadcast, sync_tensors
from ..distributed.mesh import fsdp_submesh, tp_submesh
from ._buffers import broadcast_changed_buffers
from ._forward import route_forward_through_call
from .activation_checkpoint import apply_activation_checkpointing
from .fsdp import wrap_ddp, wrap_fsdp
from .init_from import load_weights
from .memory_report import log_summary
from .meta_init import materialize
from .plan import ModelPlan
from .precision import compute_dtype, install_precision
from .tp import apply_tp
from .tp_region import sum_replicated_grads
from .tp_rng import check_rng_at_first_forward, sync_rng
from .tp_sequence import install_sequence_check

__all__ = ["AcceleratedState", "ParallelizeFn", "shard_model", "remap_optimizer"]

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
    tp_size: int = 1


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
        mesh: ``make_mesh(config, ...)``: FSDP/HSDP and TP over its parts when given, DDP or nothing otherwise.
        device: this rank's device.
        world_size: the job's world size.
        parallelize_fn: replaces the class-name wrapping: called as ``fn(model, mesh, mp_policy)``.
        mp_policy: replaces the policy derived from ``config.compute``.

    Returns:
        ``model``, sharded, on ``device``, with ``get_shard_metadata`` and a ``load_state_dict`` that
        accepts full, DTensor and local-shard state dicts.
    """
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if plan.meta else {}
    init_from = config.dist.fsdp.init_from
    if mesh is not None and config.dist.fsdp.sync_module_states and not plan.meta and init_from is None:
        sync_tensors([*model.parameters(), *model.buffers()])  # on the full tensors, before anything is split
    originals = dict(model.named_parameters()) if mesh is not None else {}
    tp_mesh = tp_submesh(mesh)
    if tp_mesh is not None:
        sync_rng(tp_mesh, device=device)  # see [Note: one random stream per TP group] in tp_rng.py
    if plan.tp is not None and parallelize_fn is None:
        apply_tp(model, tp_mesh, plan.tp)
    shard_mesh = fsdp_submesh(mesh)
    if config.memory.gc:
        apply_activation_checkpointing(
            model, plan.gc_classes, num_layers=config.memory.gc_cnt, interval=config.memory.gc_interval
        )
    if config.compute.compile:
        _compile_blocks(model, plan.wrap_classes)
    dtype = compute_dtype(bf16=config.compute.bf16, fp16=config.compute.fp16, device=device)
    if mp_policy is not None and mp_policy.param_dtype in (torch.bfloat16, torch.float16):
        dtype = mp_policy.param_dtype
    offload = None
    if config.memory.offload_params:
        if device.type == "cuda" and shard_mesh is not None:
            offload = CPUOffloadPolicy()
        elif device.type == "cuda":
            warn_once("memory.offload_params=True needs FSDP (dist.fsdp.size > 1); it is ignored without sharding")
        else:
            warn_once("memory.offload_params=True is ignored on a CPU run: parameters already live in CPU memory")
    autocast_dtype = dtype
    if shard_mesh is not None or (parallelize_fn is not None and mesh is not None):
        reduce_dtype = getattr(torch, config.dist.fsdp.reduce_dtype)
        mp_policy = mp_policy or MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
        if mp_policy.param_dtype is not None:
            autocast_dtype = None  # the policy casts: see [Note: one precision mechanism] in precision.py
        # See [Note: shard before moving]: no model.to(device) here.
        if parallelize_fn is not None:
            model = parallelize_fn(model, mesh, mp_policy) or model
        else:
            wrap_fsdp(
                model,
                shard_mesh,
                plan.wrap_classes,
                mp_policy=mp_policy,
                reshard_after_forward=config.dist.fsdp.reshard_after_forward,
                offload_policy=offload,
                forward_prefetch=config.dist.fsdp.forward_prefetch,
                backward_prefetch=config.dist.fsdp.backward_prefetch,
            )
        _fill(model, plan, device=device, buffers=buffers, init_from=init_from)
        if config.dist.fsdp.broadcast_buffers:
            broadcast_changed_buffers(model)
        for name, param in model.named_parameters():
            param._torchacc_name = name  # names the parameter in optimizer-state errors
        watch_optimizers()
    else:
        if not plan.meta:
            model.to(device)
        _fill(model, plan, device=device, buffers=buffers, init_from=init_from)
        if plan.tp is not None:  # TP alone: DTensor parameters too (see [Note: plain optimizer loads])
            for name, param in model.named_parameters():
                param._torchacc_name = name
            watch_optimizers()
        if world_size > 1 and plan.tp is None:
            wrap_ddp(
                model,
                sync_module_states=config.dist.fsdp.sync_module_states and init_from is None,
                broadcast_buffers=config.dist.fsdp.broadcast_buffers,
            )
    if tp_mesh is not None:  # the checks go in front of FSDP's hooks: nothing has communicated yet
        sum_replicated_grads(model)
        check_rng_at_first_forward(model, tp_mesh, device=device)
        if plan.tp is not None and plan.tp.sequence_parallel and parallelize_fn is None:
            install_sequence_check(model, size=tp_mesh.size())
    # The tags name the parameters that TP or sharding replaced: an optimizer still holding one is remapped
    # (optimizer=) or fails at its first step instead of training nothing.
    current = dict(model.named_parameters())
    for name, param in originals.items():
        if current.get(name) is not param:
            param._torchacc_replaced = name
    if dtype is not None:
        install_precision(model, device_type=device.type, autocast_dtype=autocast_dtype)
    if mesh is not None or world_size > 1:
        route_forward_through_call(model)
    if not hasattr(type(model), "device"):
        model.device = device
    # Checkpoint helpers on the instance: TorchAcc scripts call model.get_shard_metadata(), and
    # load_state_dict must also take full (consolidated) and local-shard state dicts.
    model.get_shard_metadata = MethodType(get_shard_metadata, model)
    model.load_state_dict = MethodType(load_state_dict, model)
    dp_size = config.resolved_dp_size(world_size)
    run_id = broadcast(uuid.uuid4().hex)  # every rank draws one; all keep rank 0's
    model._torchacc = AcceleratedState(
        device, mesh, dp_size, config.dist.fsdp.size, dtype, run_id, tp_size=config.dist.tp.size
    )
    log_summary(model)  # one line on rank 0: the layout and the parameter memory per rank
    return model


def _fill(
    model: nn.Module, plan: ModelPlan, *, device: torch.device, buffers: dict[str, torch.Tensor], init_from: str | None
) -> None:
    """Give a meta-device model its values (own init or ``init_from``); load ``init_from`` into a real one."""
    if plan.meta:
        materialize(model, device=device, buffers=buffers, init_from=init_from)
    elif init_from is not None:
        load_weights(model, init_from)


def remap_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Point ``optimizer`` at the sharded parameters, sharding any state it already has like them."""
    new_params = dict(model.named_parameters())

    def remap(param: nn.Parameter) -> nn.Parameter:
        name = getattr(param, "_torchacc_replaced", None)
        return param if name is None else new_params[name]

    for group in optimizer.param_groups:
        group["params"] = [remap(p) for p in group["params"]]
    for old, state in list(optimizer.state.items()):
        new = remap(old)
        del optimizer.state[old]
        optimizer.state[new] = {
            key: shard_like(new, getattr(new, "_torchacc_name", "?"), key, v) for key, v in state.items()
        }
    if any(isinstance(p, DTensor) for p in new_params.values()):
        attach_load_hook(optimizer)
