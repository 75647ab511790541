"""``dist.fsdp.init_from``: fill a (sharded) model's tensors from a consolidated ``.pth`` or a Hugging Face
directory, each rank reading only its own slices; where only rank 0 can read the file (a node-local disk),
rank 0 reads each tensor and sends it, one at a time. No rank ever holds the whole state dict.

[Note: init_from checks] Before any rank loads anything, every tensor's shape and dtype in the checkpoint
(read from the file's header or pickle, no tensor data) is compared with the model's, and the first
difference is raised on every rank: a checkpoint of a bigger model would otherwise load cut to its leading
block, a smaller one fail halfway with a size error naming no key. A floating-point tensor may load into
one of another floating-point dtype (a bf16 checkpoint into a float32 model): it is converted, as
``from_pretrained(torch_dtype=...)`` does. A read failing halfway (a damaged file, an I/O error) is shared
too: in the rank-0 loop each tensor travels with a status byte, so the others stop at once instead of
waiting in the next broadcast until ``dist.timeout``; where every rank reads, the ranks exchange their errors
once the reading is done.
"""

import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .._utils.tied import tied_names
from ..distributed import env
from ..distributed.collectives import raise_on_any_rank

__all__ = ["load_weights", "local_slices"]

_WHAT = "loading dist.fsdp.init_from"


def load_weights(model: nn.Module, path: str) -> None:
    """Fill ``model``'s (possibly sharded) tensors from the checkpoint ``path``. Every rank must call it.

    Each rank reads only its own slices where it can read ``path``; where only rank 0 can (a node-local
    disk), rank 0 reads each tensor and sends it, one at a time. Nothing is loaded before every tensor's
    shape and dtype were compared with the model's (see [Note: init_from checks]).

    Raises:
        ValueError: on every rank: rank 0 cannot read ``path``; the checkpoint lacks a tensor of the model or
            holds one in another shape, or in another dtype that is not a floating-point one converted to
            the model's; a read fails on some rank while loading.
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


class _Spec(NamedTuple):
    """A checkpoint tensor as its file describes it, without its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype | str  # a safetensors dtype name torch does not know stays a string
    file: str


_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _open_source(path: str) -> tuple[dict[str, _Spec], Callable[[str, tuple[slice, ...]], torch.Tensor]]:
    """Every tensor of a checkpoint (shape, dtype, file) and a reader of one slice of one tensor; no data is read."""
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
        specs = {}
        for key, file in files.items():
            if file not in handles:
                handles[file] = safe_open(file, "pt")
            if key not in handles[file].keys():  # noqa: SIM118 - safe_open is not a Mapping
                raise ValueError(f"{index} maps {key} to {file}, which lacks it; the directory is incomplete")
            piece = handles[file].get_slice(key)
            dtype = piece.get_dtype()
            specs[key] = _Spec(tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(dtype, dtype), file)

        def read(key: str, index: tuple[slice, ...]) -> torch.Tensor:
            file = handles[files[key]]
            return file.get_slice(key)[index] if index else file.get_tensor(key)

        return specs, read
    data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    state = data.get("model", data) if isinstance(data, dict) else {}
    specs = {k: _Spec(tuple(v.shape), v.dtype, path) for k, v in state.items() if isinstance(v, torch.Tensor)}
    return specs, lambda key, index: state[key][index]


def _converts(source: torch.dtype | str, target: torch.dtype) -> bool:
    """Whether a checkpoint tensor of dtype ``source`` loads into a model tensor of dtype ``target``."""
    if source == target:
        return True
    return isinstance(source, torch.dtype) and source.is_floating_point and target.is_floating_point


def _describe(shape: tuple[int, ...], dtype: torch.dtype | str) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"


def _check(model: nn.Module, specs: dict[str, _Spec], path: str) -> tuple[dict[str, str], str | None]:
    """Each state_dict key -> the key to read it from (a tied weight may be stored once), and the error text for
    the first tensor the checkpoint lacks or holds in a shape or dtype that does not fit (None when all fit)."""
    aliases = tied_names(model.named_parameters(remove_duplicate=False))
    sources, missing, differ = {}, [], []
    for key, target in model.state_dict().items():
        source = key if key in specs else aliases.get(key, key)
        if source not in specs:
            missing.append(key)
            continue
        sources[key] = source
        spec = specs[source]
        if spec.shape != tuple(target.shape) or not _converts(spec.dtype, target.dtype):
            differ.append((key, source, spec, target))
    if missing:
        return sources, f"dist.fsdp.init_from={path!r} lacks {len(missing)} tensor(s) of the model, first: {missing[0]}"
    if not differ:
        return sources, None
    key, source, spec, target = differ[0]
    stored = f" (stored as {source})" if source != key else ""
    more = f"; {len(differ) - 1} more differ, next: {differ[1][0]}" if len(differ) > 1 else ""
    return sources, (
        f"dist.fsdp.init_from={path!r}: {key}{stored} is {_describe(spec.shape, spec.dtype)} in {spec.file} but "
        f"{_describe(tuple(target.shape), target.dtype)} in the model{more}; load a checkpoint of this model, or "
        "build the model from the checkpoint's config (only a floating-point dtype may differ: it is converted)"
    )


def _unreadable(path: str, exc: Exception, *, where: str = "") -> str:
    return f"dist.fsdp.init_from={path!r} cannot be read{where}: {type(exc).__name__}: {exc}"


def _load_slices(model: nn.Module, path: str) -> None:
    """Fill ``model``'s (sharded) tensors from ``path``: every rank reads only its own slices."""
    sources: dict[str, str] = {}
    read = None
    try:
        specs, read = _open_source(path)
        sources, error = _check(model, specs, path)
    except Exception as exc:  # shared below, so that no rank goes on without the others
        error = _unreadable(path, exc)
    raise_on_any_rank(error, what=_WHAT, error_type=ValueError)
    key = None
    try:
        for key, target in model.state_dict().items():
            local = target.to_local() if isinstance(target, DTensor) else target
            local.copy_(read(sources[key], local_slices(target)))
    except Exception as exc:  # no collective inside the loop: the others learn of it at the end, not later
        error = _unreadable(path, exc, where=f" at {key}")
    raise_on_any_rank(error, what=_WHAT, error_type=ValueError)


def _broadcast_from_rank0(model: nn.Module, path: str) -> None:
    """Rank 0 reads each tensor and sends it, one at a time; every rank keeps its slice (no one holds a dict)."""
    read = None
    sources: dict[str, str] = {}
    error = None
    if env.rank() == 0:
        try:
            specs, read = _open_source(path)
            sources, error = _check(model, specs, path)
        except Exception as exc:  # shared below, so that no rank waits for a rank 0 that gave up
            error = _unreadable(path, exc, where=" on rank 0")
    raise_on_any_rank(error, what=_WHAT, error_type=ValueError)
    for key, target in model.state_dict().items():
        # the tensor's bytes and one status byte in one message: a failed read reaches every rank with the
        # tensor it replaces, at no extra collective, and no rank waits for a tensor that will never come
        num_bytes = target.numel() * target.element_size()
        message = torch.empty(num_bytes + 1, dtype=torch.uint8, device=env.device())
        full, sent = message[:num_bytes].view(target.dtype).view(target.shape), message[num_bytes:]
        if read is not None:
            try:
                full.copy_(read(sources[key], ()))
            except Exception as exc:
                error = _unreadable(path, exc, where=f" on rank 0 at {key}")
            sent.fill_(error is None)
        dist.broadcast(message, src=0)
        if not sent.item():
            break
        try:
            local = target.to_local() if isinstance(target, DTensor) else target
            local.copy_(full[local_slices(target)])
        except Exception as exc:
            error = _unreadable(path, exc, where=f" at {key}")
    raise_on_any_rank(error, what=_WHAT, error_type=ValueError)
