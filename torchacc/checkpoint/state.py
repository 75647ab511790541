"""Describe and load the state of an accelerated model: ``get_shard_metadata`` and ``load_state_dict``.

[Note: shard metadata] ``model.get_shard_metadata()`` records, for every ``state_dict`` key, the
full shape and dtype, the placements over the mesh and this rank's slice (offset and local shape).
That is all an offline tool needs to rebuild full tensors from per-rank files, without the model,
its code or a process group. Placements are strings: ``"replicate"``, ``"shard:<dim>"`` or
``"strided_shard:<dim>:<split factor>"`` (FSDP over a tensor-parallel dim, ``_StridedShard``). The
top-level ``"mesh"`` is the first DTensor's; a tensor on another mesh (with tensor parallelism, the
TP-split weights live on the 2-D ``(fsdp, tp)`` mesh and the others on the ``fsdp`` mesh) carries its
own ``"mesh"`` entry. Whatever the placements, a rank's piece is the block ``offset`` + ``local_shape``
of the full tensor: the offline tools read nothing else.
``"run_id"`` (a hex string, the same on every rank of one accelerated model and new for each
``accelerate()``) tells the files of two runs apart, so the offline tools never merge them; files
saved before it existed have none and are accepted, unless mixed with files that have one.
Under pipeline parallelism each rank holds only its stages' tensors: ``"pipeline": {"rank", "size"}`` says which
stage group the rank belongs to, so that the offline tools take each tensor from the ranks that hold it.
"""

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from .._utils.tree import map_tensors
from ..distributed import env
from ..parallel.accelerated import accelerated_state

__all__ = ["FORMAT", "get_shard_metadata", "load_state_dict", "check_shard_metadata", "parse_dtype", "local_slice"]
__all__ += ["dtensor_like", "gather_full", "require_whole_model", "is_sharded", "canonical_name"]

FORMAT = "torchacc-shards/1"


_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """``name`` without the segments that wrappers (torch.compile, checkpoint_wrapper, FSDP1) insert."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def parse_dtype(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in shard metadata")
    return dtype


def _placement_name(key: str, placement: Any) -> str:
    if isinstance(placement, _StridedShard):  # not a Shard subclass: test it first all the same
        return f"strided_shard:{placement.dim}:{placement.split_factor}"
    if isinstance(placement, Shard):
        return f"shard:{placement.dim}"
    if isinstance(placement, Replicate):
        return "replicate"
    raise ValueError(
        f"{key}: placement {placement!r} cannot be saved as shards (only Shard, _StridedShard and Replicate); "
        "save the full state instead (torchacc.save(model.state_dict(), path), which gathers it)"
    )


def is_sharded(placements: list[str]) -> bool:
    """Whether a tensor with these placement names is split across ranks (its pieces differ)."""
    return any(p.startswith(("shard:", "strided_shard:")) for p in placements)


def _mesh_info(mesh: Any) -> dict[str, Any]:
    return {
        "shape": list(mesh.shape),
        "dim_names": list(mesh.mesh_dim_names or ()),
        "coordinate": list(mesh.get_coordinate() or ()),
    }


def _block(value: DTensor) -> tuple[list[int], list[int]]:
    """(offset, local shape) of this rank's piece of ``value``; every placement torch has, strided ones included."""
    local, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return list(offset), list(local)


def local_slice(
    shape: tuple[int, ...], placements: list[str], mesh_shape: list[int], coordinate: list[int]
) -> tuple[list[int], list[int]]:
    """The (offset, local shape) of one rank's piece of a tensor sharded with ``torch.chunk`` semantics."""
    offset, local = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(placements):
        if placement.startswith("shard:"):
            dim = int(placement.split(":")[1])
            chunk = -(-shape[dim] // mesh_shape[mesh_dim])
            offset[dim] = min(coordinate[mesh_dim] * chunk, shape[dim])
            local[dim] = max(0, min(chunk, shape[dim] - offset[dim]))
    return offset, local


def get_shard_metadata(model: nn.Module) -> dict[str, Any]:
    """Describe how ``model``'s state is split across ranks (see [Note: shard metadata]).

    Returns:
        ``{"format", "world_size", "rank", "run_id", "mesh": {"shape", "dim_names", "coordinate"} or None,
        "tensors": {key: {"kind", "shape", "dtype", "placements", "offset", "local_shape"[, "mesh"]}}}``; a
        tensor's ``"mesh"`` is there only where its mesh differs from the top-level one (tensor parallelism).
        Buffers (and every tensor of a replicated or single-process model) are ``["replicate"]``.
        ``"run_id"`` is left out for a model that torchacc did not accelerate; ``"pipeline": {"rank", "size"}``
        is there only under pipeline parallelism (this rank's stage group, and how many there are).

    Raises:
        ValueError: a DTensor with a placement that has no piece of its own (``Partial``).

    Example:
        >>> ckpt = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()}
    """
    param_keys = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    mesh_info = None
    tensors = {}
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue
        entry: dict[str, Any] = {"kind": "param" if key in param_keys else "buffer", "dtype": str(value.dtype)}
        entry["shape"] = list(value.shape)
        if isinstance(value, DTensor):
            info = _mesh_info(value.device_mesh)
            mesh_info = mesh_info or info
            if info != mesh_info:
                entry["mesh"] = info
            entry["placements"] = [_placement_name(key, p) for p in value.placements]
            offset, local = _block(value)
            if local != list(value.to_local().shape):
                raise ValueError(
                    f"{key}: its placements {entry['placements']} give a local shape {local}, but this rank holds "
                    f"{list(value.to_local().shape)}; this layout cannot be described as shards, save the full state"
                )
        else:
            entry["placements"] = ["replicate"]
            offset, local = [0] * value.dim(), list(value.shape)
        entry["offset"], entry["local_shape"] = offset, local
        tensors[key] = entry
    meta = {"format": FORMAT, "world_size": env.world_size(), "rank": env.rank(), "mesh": mesh_info, "tensors": tensors}
    accelerated = accelerated_state(model)
    if accelerated is not None:
        meta["run_id"] = accelerated.run_id
        if accelerated.layout.dims.pp > 1 and accelerated.mesh is not None:
            meta["pipeline"] = {"rank": accelerated.mesh["pp"].get_local_rank(), "size": accelerated.layout.dims.pp}
    return meta


def load_state_dict(
    model: nn.Module,
    state_dict: dict[str, Any],
    strict: bool = True,
    assign: bool = False,
    *,
    shard_metadata: dict[str, Any] | None = None,
) -> Any:
    """``model.load_state_dict`` for an accelerated model, accepting three kinds of state dict.

    * a full (consolidated) state dict of plain tensors: each rank keeps its own slice (no
      communication); this is how ``torch.load("consolidated.pth")["model"]`` is loaded;
    * a state dict of DTensors laid out like the model (``model.state_dict()`` of a twin run);
    * this rank's local shards, as saved by ``torchacc.save(..., master_only=False)``, together with
      ``shard_metadata=`` saved beside them by the same rank.

    Args:
        model: the accelerated model.
        state_dict: one of the above.
        strict, assign: as in ``torch.nn.Module.load_state_dict``.
        shard_metadata: ``model.get_shard_metadata()`` of the run that saved local shards.

    Returns:
        ``torch.nn.Module.load_state_dict``'s result (missing and unexpected keys).

    Raises:
        ValueError: a tensor that is neither full-shaped nor a matching local shard; local shards from
            another rank, world size or layout (the message says to consolidate or reshard first).
    """
    if shard_metadata is not None:
        check_shard_metadata(shard_metadata)
    targets = model.state_dict()
    converted = {}
    for key, value in state_dict.items():
        target = targets.get(key)
        if isinstance(target, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = _to_dtensor(key, value, target, shard_metadata)
        converted[key] = value
    return nn.Module.load_state_dict(model, converted, strict=strict, assign=assign)


def check_shard_metadata(meta: dict[str, Any]) -> None:
    """Raise ValueError unless ``meta`` is shard metadata saved by this rank of a run of this world size."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError("shard_metadata is not from model.get_shard_metadata(); pass the dict saved with the shards")
    here = (env.rank(), env.world_size())
    if (meta["rank"], meta["world_size"]) != here:
        raise ValueError(
            f"these local shards were saved by rank {meta['rank']} of {meta['world_size']}, but this is rank {here[0]} "
            f"of {here[1]}; load the file saved by this rank, or consolidate the shards "
            "(torchacc.dist.fsdp.consolidate_sharded_model_checkpoints) or reshard them (torchacc.reshard_checkpoint)"
        )


def gather_full(obj: Any, *, keep: bool = True, defaultdict_as_dict: bool = False) -> Any:
    """``obj`` with every DTensor gathered to its full tensor and every tensor moved to the CPU.

    The one "gather to full" path. Every rank must call it (each DTensor is one collective, in a fixed
    order); a rank that ``keep=False`` takes part in the gathers but keeps nothing (its tensors become None).
    ``defaultdict_as_dict`` is as in ``torchacc._utils.tree.map_tensors``.
    """

    def full(tensor: torch.Tensor) -> torch.Tensor | None:
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return tensor.detach().cpu() if keep else None

    return map_tensors(full, obj, defaultdict_as_dict=defaultdict_as_dict)


def require_whole_model(model: nn.Module) -> None:
    """Raise, on every rank, for a pipelined model (``dist.pp.size > 1``): no rank holds the other stages, so
    the whole model cannot be gathered on one (a full state dict, ``save_model``, a live ``export_hf``)."""
    accelerated = accelerated_state(model)
    if accelerated is not None and accelerated.layout.dims.pp > 1:
        raise ValueError(
            "gathering the whole model on one rank (FSDP2Strategy state_dict_type='full', save_model) does not work "
            "under dist.pp.size > 1, where each rank holds only its pipeline stages; save a sharded checkpoint "
            "(state_dict_type='sharded', save_ckpt, torchacc.save_checkpoint) and consolidate it offline"
        )


def dtensor_like(target: DTensor, value: torch.Tensor, *, local: bool = False) -> DTensor | None:
    """``value`` as a DTensor laid out like ``target``, without communication; None if it fits neither way.

    A full-shaped ``value`` is cut to this rank's piece; with ``local``, a ``value`` of this rank's local
    shape is taken as that piece. The one converter for model and optimizer state.
    """
    value = value.to(target.device)
    if value.shape == target.shape:  # this rank's block, cut as distribute_tensor would (strided placements too)
        offset, local_shape = _block(target)
        value = value[tuple(slice(o, o + n) for o, n in zip(offset, local_shape, strict=True))].clone()
    elif not (local and value.shape == target.to_local().shape):
        return None
    return DTensor.from_local(value, target.device_mesh, target.placements, shape=target.shape, stride=target.stride())


def _to_dtensor(key: str, value: torch.Tensor, target: DTensor, meta: dict[str, Any] | None) -> DTensor:
    if meta is not None:
        entry = meta["tensors"].get(key)
        offset, local = _block(target)
        saved = None if entry is None else (entry["offset"], entry["local_shape"])
        converted = dtensor_like(target, value, local=True) if saved == (offset, local) else None
        if converted is None or list(value.shape) != local:
            what = (
                "shard_metadata has no entry for it"
                if saved is None
                else f"the saved local shard is the block at offset {saved[0]} of shape {saved[1]}"
            )
            raise ValueError(
                f"{key}: {what}, but this rank holds the block at offset {offset} of shape {local} (a different "
                "sharding layout); consolidate the shards and load the full state dict instead"
            )
        return converted
    converted = dtensor_like(target, value)
    if converted is None:
        raise ValueError(
            f"{key}: got shape {tuple(value.shape)}, expected the full shape {tuple(target.shape)}; to load this "
            "rank's local shards pass shard_metadata= (the dict saved with them by model.get_shard_metadata())"
        )
    return converted
