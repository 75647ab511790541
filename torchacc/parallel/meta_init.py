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

[Note: meta init under a pipeline] A pipeline rank holds only its stages, but a single process draws the
random values of every tensor of the whole model, in the order of its module tree: skipping the other stages'
draws would shift every later draw. So the own init runs over the whole tree: the engine passes a context
(``whole_model_scope`` in pipeline_stages.py) that puts the other stages' modules, still on the meta device, back in
their places while the init runs, and ``_FullTensorRandom`` lets each random fill of a meta tensor draw into
a temporary tensor of its shape on ``device`` that is thrown away, one tensor at a time. The generator then
advances exactly as in one process, and this rank's tensors get one process's values; nothing of the other
stages is ever allocated beyond one temporary tensor.

[Note: meta init in place] An init may also write through an index or a view of a parameter, which DTensor
cannot give for a sharded dimension: HF's ``init.zeros_(embedding.weight[padding_idx])`` zeroes a copy of the
padding row, and the shard keeps its random draw. So while a module's own init runs, each of its sharded
parameters is swapped for a plain tensor of the full shape that holds this rank's values at its slice; the
init writes into it as into an unsharded parameter (random fills draw the full tensor, as one process does) and
the rank copies its slice back. Only one module's own parameters are whole at a time.

[Note: meta init seeds] The draws must also not depend on how each rank was seeded: scripts often seed
per rank (``torch.manual_seed(100 + rank)``) for dropout, and a model built normally is then made equal by
``sync_module_states``, but a meta model has nothing to sync. So the own init runs from rank 0's random state
(broadcast once), which makes HSDP's replicas and the parameters TP leaves whole start equal, and equal to one
process seeded like rank 0; each rank gets its own state back afterwards.
"""

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .._utils.tied import retie, tied_names
from ..distributed.collectives import broadcast
from .init_from import load_weights, local_slices

__all__ = ["init_empty_weights", "has_meta_params", "check_materializable", "materialize"]


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
        with _own_params_whole(module):
            init(module)
        for param in module.parameters(recurse=False):
            if id(param) in tied:
                # The first owner of a tied weight initializes it; later ones (lm_head) keep it, as HF does.
                param._is_hf_initialized = True

    tied = {
        id(model.get_parameter(owner)) for owner in tied_names(model.named_parameters(remove_duplicate=False)).values()
    }

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


def materialize(
    model: nn.Module,
    *,
    device: torch.device,
    buffers: dict[str, torch.Tensor],
    init_from: str | None,
    whole_model: Callable[[], AbstractContextManager[None]] | None = None,
) -> None:
    """Allocate ``model``'s (sharded) meta parameters on ``device`` and initialize them.

    Args:
        model: a model, usually already sharded, with meta parameters.
        device: where to allocate.
        buffers: the real buffer values taken before (restored after ``to_empty``).
        init_from: a consolidated ``.pth`` or an HF safetensors directory; None runs the model's own init
            (see [Note: meta init RNG]).
        whole_model: for a model cut down to its pipeline stages, a context in which it holds the whole model's
            modules again, the other stages' still on the meta device: the own init runs inside it (see
            [Note: meta init under a pipeline]).
    """
    aliases = tied_names(model.named_parameters(remove_duplicate=False))
    model.to_empty(device=device)
    retie(model, aliases)  # to_empty gives each name of a tied meta parameter a parameter of its own
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    if init_from is not None:
        load_weights(model, init_from)
        return
    whole = whole_model() if whole_model is not None else contextlib.nullcontext()
    with torch.no_grad(), _random_state_of_rank0(device), _FullTensorRandom(device), whole:
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
                    with _own_params_whole(module):
                        module.reset_parameters()


@contextlib.contextmanager
def _random_state_of_rank0(device: torch.device) -> Iterator[None]:
    """Draw from rank 0's random state inside this block: see [Note: meta init seeds]."""
    accelerator = getattr(torch, device.type) if device.type != "cpu" else None
    own = [torch.get_rng_state(), *([accelerator.get_rng_state(device)] if accelerator is not None else [])]
    shared = broadcast(own)
    torch.set_rng_state(shared[0])
    if accelerator is not None:
        accelerator.set_rng_state(shared[1], device)
    try:
        yield
    finally:
        torch.set_rng_state(own[0])
        if accelerator is not None:
            accelerator.set_rng_state(own[1], device)


@contextlib.contextmanager
def _own_params_whole(module: nn.Module) -> Iterator[None]:
    """Give ``module`` plain full-shape stand-ins for its own DTensor parameters: see [Note: meta init in place]."""
    swapped: dict[str, tuple[DTensor, torch.Tensor, tuple[slice, ...]]] = {}
    for name, param in module._parameters.items():
        if not isinstance(param, DTensor):
            continue
        local = param.to_local()
        where = local_slices(param)
        whole = torch.empty(param.shape, dtype=local.dtype, device=local.device)
        whole[where] = local
        stand_in = nn.Parameter(whole, requires_grad=param.requires_grad)
        if hasattr(param, "_is_hf_initialized"):  # HF's init skips a tensor marked initialized (a tied weight)
            stand_in._is_hf_initialized = param._is_hf_initialized
        module._parameters[name] = stand_in
        swapped[name] = (param, stand_in, where)
    try:
        yield
    finally:
        for name, (param, stand_in, where) in swapped.items():
            written = module._parameters[name]  # the init may have assigned a new parameter
            module._parameters[name] = param
            if getattr(written, "_is_hf_initialized", False) or getattr(stand_in, "_is_hf_initialized", False):
                param._is_hf_initialized = True
            if written is not None and tuple(written.shape) == tuple(param.shape):
                param.to_local().copy_(written.detach()[where])


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
    """Fill sharded tensors as if they were whole, and draw for meta tensors as if they were real: see
    [Note: meta init RNG] and [Note: meta init under a pipeline]."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func.overloadpacket in _RANDOM_FILLS and isinstance(target, DTensor):
            local = target.to_local()
            full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
            func(full, *args[1:], **kwargs)  # the same generator and arguments, on the whole tensor
            local.copy_(full[local_slices(target)])
            return target
        if func.overloadpacket in _RANDOM_FILLS and isinstance(target, torch.Tensor) and target.is_meta:
            # another stage's tensor: the draws it would take, into a tensor thrown away
            func(torch.empty(target.shape, dtype=target.dtype, device=self.device), *args[1:], **kwargs)
            return target
        return func(*args, **kwargs)
