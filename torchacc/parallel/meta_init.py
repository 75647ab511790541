"""Build a model without memory, then give each rank only its shards: meta-device init.

[Note: meta init] ``with torchacc.init_empty_weights(): model = Model(cfg)`` creates every parameter
on the meta device (no storage) while buffers stay real CPU tensors: buffers are small, and
non-persistent ones (rotary ``inv_freq``, causal masks) cannot be restored from any checkpoint, so
keeping their real values avoids the NaNs other libraries hit on non-zero ranks. After
``fully_shard``, ``materialize`` allocates only this rank's shards (``to_empty``), puts the buffers
back, and fills the shards from the model's own init or from a checkpoint, slice by slice.

[Note: meta init RNG] Running the model's own init on shards must give the values a single process
would draw for the whole model. DTensor keeps one random stream per shard only on CUDA-like devices;
elsewhere every rank draws the same numbers into its shard, so shards copy each other. While the init
runs, ``_FullTensorRandom`` turns each random fill of a sharded tensor (``normal_``, ``uniform_``, ...,
and so every ``nn.init`` function) into a fill of the full tensor from the same generator, of which the
rank keeps its slice: the result does not depend on the world size or the device, for the cost of
one full parameter at a time.
"""

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .._utils.tied import retie, tied_names
from ..checkpoint.state import local_slice
from ..dist import env
from ..distributed.collectives import raise_on_any_rank

__all__ = ["init_empty_weights", "has_meta_params", "check_materializable", "materialize", "load_weights"]


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Create parameters on the meta device (no memory) inside this block; buffers stay real.

    Example:
        >>> with torchacc.init_empty_weights():
        ...     model = AutoModelForCausalLM.from_config(cfg)
        >>> model, loader = torchacc.accelerate(model, loader, config)  # only this rank's shards are allocated
    """
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def has_meta_params(model: nn.Module) -> bool:
    """True when some parameter of ``model`` has no storage yet."""
    return any(p.is_meta for p in model.parameters())


def _hf_init(model: nn.Module) -> Callable[[], None] | None:
    """A Hugging Face model's own init, run module by module as ``PreTrainedModel.initialize_weights`` does."""
    if not (callable(getattr(model, "init_weights", None)) and callable(getattr(model, "_init_weights", None))):
        return None

    def visit(module: nn.Module, init: Callable[[nn.Module], None]) -> None:
        for child in module.children():  # children first; a nested HF model brings its own _init_weights
            own = getattr(child, "_init_weights", None)
            visit(child, own if callable(own) and hasattr(child, "init_weights") else init)
        init(module)
        for param in module.parameters(recurse=False):
            if id(param) in tied:
                # The first owner of a tied weight initializes it; later ones (lm_head) keep it, as HF does.
                param._is_hf_initialized = True

    tied = {id(model.get_parameter(owner)) for owner in tied_names(model).values()}

    def initialize() -> None:
        # Not init_weights(): it skips modules it takes for remote code, and it takes the FSDP-wrapped class
        # (fully_shard swaps the class) for remote code, so the result would depend on the world size.
        visit(model, model._init_weights)
        tie = getattr(model, "tie_weights", None)
        if callable(tie):
            tie()

    return initialize


def check_materializable(model: nn.Module, init_from: str | None) -> None:
    """Raise ValueError (before any collective) unless a meta-device ``model`` can be materialized.

    Args:
        model: a model with meta parameters.
        init_from: the checkpoint that will fill it, or None for the model's own init.
    """
    meta_buffers = [name for name, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise ValueError(
            f"{type(model).__name__} has buffers on the meta device (first: {meta_buffers[0]}), whose values no init "
            "can restore; build the model under torchacc.init_empty_weights(), which keeps buffers real"
        )
    if init_from is not None:
        return  # whether the ranks can read it is checked when it is loaded (see load_weights)
    if _hf_init(model) is not None:
        return
    bare = [
        name or type(model).__name__
        for name, module in model.named_modules()
        if any(p.is_meta for p in module.parameters(recurse=False))
        and not callable(getattr(module, "reset_parameters", None))
    ]
    if bare:
        raise ValueError(
            f"{type(model).__name__} has parameters on the meta device and no way to initialize them: module "
            f"{bare[0]!r} has no reset_parameters(); set config.dist.fsdp.init_from to a checkpoint, give the module a "
            "reset_parameters(), or build the model on the CPU"
        )


def _slices(target: torch.Tensor) -> tuple[slice, ...]:
    """This rank's piece of a (possibly DTensor) target, as slices of the full tensor."""
    if not isinstance(target, DTensor):
        return tuple(slice(0, n) for n in target.shape)
    mesh = target.device_mesh
    placements = [f"shard:{p.dim}" if p.is_shard() else "replicate" for p in target.placements]
    offset, local = local_slice(tuple(target.shape), placements, list(mesh.shape), list(mesh.get_coordinate()))
    return tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))


def _open_source(path: str) -> tuple[set[str], Callable[[str, tuple[slice, ...]], torch.Tensor]]:
    """The keys of a checkpoint and a reader of one slice of one tensor, without loading the rest."""
    if os.path.isdir(path):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = {key: os.path.join(path, name) for key, name in json.load(f)["weight_map"].items()}
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.isfile(single):
                raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json in this directory")
            with safe_open(single, "pt") as f:
                files = {key: single for key in f.keys()}  # noqa: SIM118 - safe_open is not a Mapping
        handles: dict[str, Any] = {}

        def read(key: str, index: tuple[slice, ...]) -> torch.Tensor:
            file = files[key]
            if file not in handles:
                handles[file] = safe_open(file, "pt")
            return handles[file].get_slice(key)[index] if index else handles[file].get_tensor(key)

        return set(files), read
    data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    state = data.get("model", data)
    return set(state), lambda key, index: state[key][index]


def _source_keys(model: nn.Module, keys: set[str]) -> tuple[dict[str, str], list[str]]:
    """Each state_dict key -> the key to read it from (a tied weight may be stored once), and the missing keys."""
    aliases = tied_names(model)
    sources, missing = {}, []
    for key in model.state_dict():
        source = key if key in keys else aliases.get(key, key)
        if source in keys:
            sources[key] = source
        else:
            missing.append(key)
    return sources, missing


def _missing_error(path: str, missing: list[str]) -> ValueError:
    return ValueError(f"dist.fsdp.init_from={path!r} lacks {len(missing)} tensor(s) of the model, first: {missing[0]}")


def _load_slices(model: nn.Module, path: str) -> None:
    """Fill ``model``'s (sharded) tensors from ``path``: every rank reads only its own slices."""
    keys, read = _open_source(path)
    sources, missing = _source_keys(model, keys)
    if missing:
        raise _missing_error(path, missing)
    for key, target in model.state_dict().items():
        local = target.to_local() if isinstance(target, DTensor) else target
        local.copy_(read(sources[key], _slices(target)))


def _broadcast_from_rank0(model: nn.Module, path: str) -> None:
    """Rank 0 reads each tensor and sends it, one at a time; every rank keeps its slice (no one holds a dict)."""
    read = None
    sources: dict[str, str] = {}
    error = None
    if env.rank() == 0:
        try:
            keys, read = _open_source(path)
            sources, missing = _source_keys(model, keys)
            error = str(_missing_error(path, missing)) if missing else None
        except Exception as exc:  # shared below, so that no rank waits for a rank 0 that gave up
            error = f"dist.fsdp.init_from={path!r} cannot be read on rank 0: {type(exc).__name__}: {exc}"
    raise_on_any_rank(error, what="loading dist.fsdp.init_from", error_type=ValueError)
    for key, target in model.state_dict().items():
        full = torch.empty(target.shape, dtype=target.dtype, device=env.device())
        if read is not None:
            full.copy_(read(sources[key], ()))
        dist.broadcast(full, src=0)
        local = target.to_local() if isinstance(target, DTensor) else target
        local.copy_(full[_slices(target)])


def materialize(
    model: nn.Module, *, device: torch.device, buffers: dict[str, torch.Tensor], init_from: str | None
) -> None:
    """Allocate ``model``'s (sharded) meta parameters on ``device`` and initialize them.

    Args:
        model: a model, usually already sharded, with meta parameters.
        device: where to allocate.
        buffers: the real buffer values taken before (restored after ``to_empty``).
        init_from: a consolidated ``.pth`` or an HF safetensors directory; None runs the model's own init
            (see [Note: meta init RNG]).
    """
    aliases = tied_names(model)
    model.to_empty(device=device)
    retie(model, aliases)  # to_empty gives each name of a tied meta parameter a parameter of its own
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    if init_from is not None:
        load_weights(model, init_from)
        return
    with torch.no_grad(), _FullTensorRandom():
        hf_init = _hf_init(model)
        if hf_init is not None:
            # HF marks modules initialized when post_init() ran on meta tensors (a no-op); unmark them so
            # init_weights() really initializes the materialized shards.
            for obj in [*model.modules(), *model.parameters()]:
                if getattr(obj, "_is_hf_initialized", False):
                    obj._is_hf_initialized = False
            hf_init()
        else:
            for module in model.modules():
                if any(True for _ in module.parameters(recurse=False)) and hasattr(module, "reset_parameters"):
                    module.reset_parameters()


def load_weights(model: nn.Module, path: str) -> None:
    """Fill ``model``'s (possibly sharded) tensors from the checkpoint ``path``. Every rank must call it.

    Each rank reads only its own slices where it can read ``path``; where only rank 0 can (a node-local
    disk), rank 0 reads each tensor and sends it, one at a time.

    Raises:
        ValueError: on every rank: rank 0 cannot read ``path``, or the checkpoint lacks a tensor of the model.
    """
    if not env.is_distributed() and not os.path.exists(path):
        raise ValueError(f"dist.fsdp.init_from={path!r} does not exist; give a .pth file or an HF directory")
    with torch.no_grad():
        if not env.is_distributed() or all(_everyone_sees(path)):
            _load_slices(model, path)
        else:
            _broadcast_from_rank0(model, path)


def _everyone_sees(path: str) -> list[bool]:
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, os.path.exists(path))
    if not flags[0]:
        raise ValueError(
            f"dist.fsdp.init_from={path!r} does not exist on rank 0; put it where rank 0 can read it (the other "
            "ranks may lack it: rank 0 then sends each tensor)"
        )
    return flags


_RANDOM_FILLS = frozenset(
    op.overloadpacket
    for op in (
        torch.ops.aten.normal_.default,
        torch.ops.aten.uniform_.default,
        torch.ops.aten.bernoulli_.float,
        torch.ops.aten.random_.default,
        torch.ops.aten.exponential_.default,
        torch.ops.aten.log_normal_.default,
        torch.ops.aten.cauchy_.default,
        torch.ops.aten.geometric_.default,
    )
)


class _FullTensorRandom(TorchDispatchMode):
    """Fill sharded tensors as if they were whole: see [Note: meta init RNG]."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func.overloadpacket in _RANDOM_FILLS and isinstance(target, DTensor):
            local = target.to_local()
            full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
            func(full, *args[1:], **kwargs)  # the same generator and arguments, on the whole tensor
            local.copy_(full[_slices(target)])
            return target
        return func(*args, **kwargs)
