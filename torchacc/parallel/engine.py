"""The sharding engine behind both ``accelerate()`` and ``FSDP2Strategy``: one code path.

After ``plan.py`` has checked the model and built the mesh, ``shard_model`` cuts a pipelined model down to
this rank's stages, then applies tensor parallelism, activation checkpointing, compilation, sharding (or DDP),
meta-device materialization and mixed precision, in that order; ``remap_optimizer`` moves an optimizer built too
early onto the sharded parameters.

[Note: shard before moving] Under FSDP the model is not moved to the device as a whole: a 70B model
would not fit on one GPU, and CPU offload would be defeated. ``fully_shard`` moves each unit's
parameters to the mesh's device as it shards it (bottom-up, one unit at a time), as TorchTitan relies on.

[Note: dry run] ``torchacc.estimate_memory`` runs this very function on a meta-device model under a fake process
group (``materialize=False``): tensor parallelism, activation checkpointing and ``fully_shard`` run as for real,
then it stops where a real run would start allocating (materialization) and installs only the precision
mechanism the step needs. Everything after that point touches memory, communicates or leaves state outside the
model (the optimizer watch, the buffer broadcast, the run id, the record, the log line), so a dry run skips it,
as well as the warnings about settings: the planner reports its own. A plain-DP layout (DDP) also stops before
``replicate``, which would broadcast the weights.
"""

import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import MethodType

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from .._utils.logging import warn_once
from ..checkpoint.hf import save_pretrained
from ..checkpoint.optimizer import attach_load_hook, shard_like, watch_optimizers
from ..checkpoint.state import get_shard_metadata, load_state_dict
from ..distributed.collectives import broadcast
from ..distributed.mesh import cp_submesh, fsdp_submesh, pp_submesh, shard_of_rank, tp_submesh
from ..distributed.sync import sync_tensors
from ._buffers import broadcast_changed_buffers
from ._forward import route_forward_through_call
from .accelerated import (
    AcceleratedState,
    parameter_name,
    record_accelerated,
    record_parameter_names,
    record_replaced,
    replaced_name,
)
from .activation_checkpoint import apply_activation_checkpointing
from .context import apply_context_parallel
from .fsdp import wrap_ddp, wrap_fsdp
from .init_from import load_weights
from .kv_cache import train_without_kv_cache
from .layout import Layout
from .memory_report import log_summary
from .meta_init import materialize
from .pipeline import restrict_tp_plan
from .pipeline_stages import split_model, whole_model_scope
from .pipeline_step import attach_pipeline
from .plan import ModelPlan
from .precision import compute_dtype, install_precision
from .tp import apply_tp
from .tp_region import sum_replicated_grads
from .tp_rng import check_rng_at_first_forward, sync_rng
from .tp_sequence import install_sequence_check

__all__ = ["ParallelizeFn", "shard_model", "remap_optimizer"]

ParallelizeFn = Callable[[nn.Module, DeviceMesh, MixedPrecisionPolicy], nn.Module | None]


def _compile_blocks(model: nn.Module, classes: frozenset[type[nn.Module]]) -> None:
    # The block's forward is compiled in place (not wrapped in an OptimizedModule): the module's
    # __call__, and so FSDP's pre/post-forward hooks, stay eager, and no "_orig_mod." enters any key.
    for module in model.modules():
        if module is not model and isinstance(module, tuple(classes)):
            module.forward = torch.compile(module.forward)


def _train_without_kv_cache(model: nn.Module, layout: Layout, *, warn: bool) -> None:
    """See [Note: no KV cache in a training forward] in kv_cache.py; one note when it changes anything."""
    names = train_without_kv_cache(model)
    if warn and any(model.get_submodule(name).config.use_cache for name in names):
        why = ["memory.gc=True"] if layout.checkpointing is not None else []
        why += ["compute.compile=True"] if layout.compile else []
        warn_once(
            f"{' and '.join(why)}: training forwards run with use_cache=False (no KV cache: checkpointed layers "
            "would append their keys again when recomputed, compiled blocks would recompile); "
            "model.config.use_cache is unchanged, so generate() and forwards under torch.no_grad() still use one"
        )


def shard_model(
    model: nn.Module,
    layout: Layout,
    plan: ModelPlan,
    *,
    mesh: DeviceMesh | None,
    device: torch.device,
    parallelize_fn: ParallelizeFn | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    materialize: bool = True,
    run_id: str | None = None,
) -> nn.Module:
    """Turn ``model`` into an accelerated model, in place. Every rank must call it (it communicates).

    Args:
        model: the plain model (possibly on the meta device, see ``torchacc.init_empty_weights``).
        layout: ``Layout.from_config(config, ...)``: everything this function does, resolved.
        plan: ``plan_model(model, layout)``.
        mesh: ``layout.dims.build_mesh(...)``: FSDP/HSDP and TP over its parts when given, DDP or nothing otherwise.
        device: this rank's device.
        parallelize_fn: replaces the class-name wrapping: called as ``fn(model, mesh, mp_policy)``.
        mp_policy: replaces the policy derived from ``config.compute``.
        materialize: False for the planner's dry run (see [Note: dry run]): the model stays on the meta device.
        run_id: the run id every rank already shares (``agree_on_config``'s); None: rank 0 draws one and sends it.

    Returns:
        ``model``, sharded, on ``device``, with ``get_shard_metadata`` and a ``load_state_dict`` that
        accepts full, DTensor and local-shard state dicts.
    """
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if plan.meta else {}
    init_from = layout.init_from
    if mesh is not None and layout.sync_module_states and not plan.meta and init_from is None:
        # On the full tensors, before anything is split. Under plain FSDP/HSDP only the chunk of each parameter
        # that a rank keeps has to match rank 0's: each rank reads only that (see sync_tensors).
        plain = parallelize_fn is None and fsdp_submesh(mesh) is mesh  # the whole mesh shards: no TP, PP or CP axis
        sync_tensors(model.parameters(), shard_of_rank=shard_of_rank(mesh) if plain else None, whole=model.buffers())
    # Held weakly: each unit's unsharded parameters are freed as soon as fully_shard replaces them (holding them
    # kept the whole model alive through sharding, and every shard then took fresh memory).
    originals = WeakIdKeyDictionary({p: n for n, p in model.named_parameters()} if mesh is not None else {})
    stages = pipeline = whole_model = None
    if plan.pp is not None and layout.pipeline is not None:  # see [Note: pipeline stages] in pipeline.py
        pipe = pp_submesh(mesh)
        local = range(pipe.get_local_rank(), plan.pp.num_stages, layout.dims.pp)
        if plan.meta:  # see [Note: meta init under a pipeline] in meta_init.py
            whole_model = whole_model_scope(model, plan.pp)
        stages = split_model(model, plan.pp, stages=local)
        buffers = {name: b for name, b in buffers.items() if name in dict(model.named_buffers())}
        pipeline = attach_pipeline(model, stages, schedule=layout.pipeline, group=pipe.get_group(), device=device)
    tp_mesh = tp_submesh(mesh)
    if tp_mesh is not None:
        sync_rng(tp_mesh, device=device)  # see [Note: one random stream per TP group] in tp_rng.py
    if plan.tp is not None and parallelize_fn is None:
        apply_tp(model, tp_mesh, restrict_tp_plan(plan.tp, model) if stages else plan.tp)
    if plan.cp is not None:
        apply_context_parallel(model, cp_submesh(mesh), plan.cp)
    shard_mesh = fsdp_submesh(mesh)
    checkpointing = layout.checkpointing
    if checkpointing is not None:
        apply_activation_checkpointing(
            model, plan.gc_classes, num_layers=checkpointing.num_layers, interval=checkpointing.interval
        )
    if layout.compile:
        _compile_blocks(model, plan.wrap_classes)
    if (checkpointing is not None or layout.compile) and stages is None:  # the stages pass use_cache=False
        _train_without_kv_cache(model, layout, warn=materialize)
    dtype = compute_dtype(layout.param_dtype, device=device) if materialize else layout.param_dtype
    if mp_policy is not None and mp_policy.param_dtype in (torch.bfloat16, torch.float16):
        dtype = mp_policy.param_dtype
    for reason in layout.ignored if materialize else ():
        warn_once(reason)
    offload = CPUOffloadPolicy() if layout.offload_params else None
    autocast_dtype = dtype
    if shard_mesh is not None or (parallelize_fn is not None and mesh is not None):
        mp_policy = mp_policy or MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=layout.reduce_dtype)
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
                reshard_after_forward=layout.reshard_after_forward,
                offload_policy=offload,
                forward_prefetch=layout.forward_prefetch,
                backward_prefetch=layout.backward_prefetch,
                roots=stages,
            )
        if not materialize:
            return _stop_before_materializing(model, device, dtype, autocast_dtype)
        _fill(model, plan, device=device, buffers=buffers, init_from=init_from, whole_model=whole_model)
        if layout.broadcast_buffers and stages is None:  # no forward-changed buffers in the decoders PP splits
            broadcast_changed_buffers(model)
        record_parameter_names(model)  # names the parameters in optimizer-state errors
        watch_optimizers()
    else:
        if not materialize:
            return _stop_before_materializing(model, device, dtype, autocast_dtype)
        if not plan.meta:
            model.to(device)
        _fill(model, plan, device=device, buffers=buffers, init_from=init_from, whole_model=whole_model)
        if plan.tp is not None:  # TP alone: DTensor parameters too (see [Note: plain optimizer loads])
            record_parameter_names(model)
            watch_optimizers()
        if layout.dims.world_size > 1 and plan.tp is None and stages is None:
            wrap_ddp(
                model,
                sync_module_states=layout.sync_module_states and init_from is None,
                broadcast_buffers=layout.broadcast_buffers,
            )
    if tp_mesh is not None:  # the checks go in front of FSDP's hooks: nothing has communicated yet
        sum_replicated_grads(model)
        check_rng_at_first_forward(model, tp_mesh, device=device)
        if plan.tp is not None and plan.tp.sequence_parallel and parallelize_fn is None:
            install_sequence_check(model, size=tp_mesh.size())
    # The parameters that TP or sharding replaced: an optimizer still holding one is remapped (optimizer=) or
    # fails at its first step instead of training nothing.
    record_replaced(originals, model)
    if dtype is not None:
        for module in [model, *(stages or [])]:  # the stages run the training forward
            install_precision(module, device_type=device.type, autocast_dtype=autocast_dtype)
    if mesh is not None or layout.dims.world_size > 1:
        route_forward_through_call(model)
    if not hasattr(type(model), "device"):
        model.device = device
    # Checkpoint helpers on the instance: TorchAcc scripts call model.get_shard_metadata(), and
    # load_state_dict must also take full (consolidated) and local-shard state dicts.
    model.get_shard_metadata = MethodType(get_shard_metadata, model)
    model.load_state_dict = MethodType(load_state_dict, model)
    if callable(getattr(model, "save_pretrained", None)):  # transformers' own cannot save sharded tensors
        model.save_pretrained = MethodType(save_pretrained, model)
    if run_id is None:
        run_id = broadcast(uuid.uuid4().hex)  # every rank draws one; all keep rank 0's
    record_accelerated(model, AcceleratedState(layout, device, mesh, dtype, run_id, pipeline))
    log_summary(model)  # one line on rank 0: the layout and the parameter memory per rank
    return model


def _stop_before_materializing(
    model: nn.Module, device: torch.device, dtype: torch.dtype | None, autocast_dtype: torch.dtype | None
) -> nn.Module:
    """The end of a dry run: the precision a real run installs, nothing else (see [Note: dry run])."""
    if dtype is not None:
        install_precision(model, device_type=device.type, autocast_dtype=autocast_dtype)
    return model


def _fill(
    model: nn.Module,
    plan: ModelPlan,
    *,
    device: torch.device,
    buffers: dict[str, torch.Tensor],
    init_from: str | None,
    whole_model: Callable[[], AbstractContextManager[None]] | None,
) -> None:
    """Give a meta-device model its values (own init or ``init_from``); load ``init_from`` into a real one."""
    if plan.meta:
        materialize(model, device=device, buffers=buffers, init_from=init_from, whole_model=whole_model)
    elif init_from is not None:
        load_weights(model, init_from)


def remap_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Point ``optimizer`` at the sharded parameters, sharding any state it already has like them."""
    new_params = dict(model.named_parameters())

    def remap(param: nn.Parameter) -> nn.Parameter | None:
        name = replaced_name(param)
        return param if name is None else new_params.get(name)  # None: another pipeline stage holds it

    for group in optimizer.param_groups:
        group["params"] = [new for new in map(remap, group["params"]) if new is not None]
    for old, state in list(optimizer.state.items()):
        new = remap(old)
        del optimizer.state[old]
        if new is None:
            continue
        optimizer.state[new] = {key: shard_like(new, parameter_name(new), key, v) for key, v in state.items()}
    if any(isinstance(p, DTensor) for p in new_params.values()):
        attach_load_hook(optimizer)
