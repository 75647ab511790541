"""``dist.fsdp.init_from``: fill a (sharded) model's tensors from a consolidated ``.pth`` or a Hugging Face
directory, each rank reading only its own slices; where only rank 0 can read the file (a node-local disk),
rank 0 reads each tensor and sends it, one at a time. No rank ever holds the whole state dict.
"""

import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .._utils.tied import tied_names
from ..distributed import env
from ..distributed.collectives import raise_on_any_rank

__all__ = ["load_weights", "local_slices"]


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


def local_slices(target: torch.Tensor) -> tuple[slice, ...]:
    """This rank's piece of a (possibly DTensor) target, as slices of the full tensor."""
    if not isinstance(target, DTensor):
        return tuple(slice(0, n) for n in target.shape)
    # DTensor's own arithmetic: it knows every placement, FSDP's _StridedShard over a TP shard included (the
    # piece stays one contiguous block of the full tensor); its shape is checked, a wrong one would load silently
    local, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if tuple(local) != tuple(target.to_local().shape):
        raise AssertionError(f"local piece {tuple(local)} at {tuple(offset)} != the shard's {target.to_local().shape}")
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
    aliases = tied_names(model.named_parameters(remove_duplicate=False))
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
        local.copy_(read(sources[key], local_slices(target)))


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
        local.copy_(full[local_slices(target)])
