"""``dist.fsdp.init_from``: fill a (sharded) model's tensors from a consolidated ``.pth`` or a Hugging Face
directory. Rank 0 reads the checkpoint a group of tensors at a time (one file at most, about 1 GiB)
and torch's ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends each tensor to every rank, which keeps
its own slice: no rank holds the whole state dict, and the other ranks need not see the file (a node-local disk).

[Note: init_from checks] Before anything is loaded, every tensor's shape and dtype in the checkpoint (read from
the file's header or pickle, no tensor data) is compared with every rank's model, and the first difference is
raised on every rank: a checkpoint of a bigger model would otherwise load cut to its leading block, a smaller one
fail halfway with a size error naming no key. A floating-point tensor may load into one of another
floating-point dtype (a bf16 checkpoint into a float32 model): it is converted, as
``from_pretrained(torch_dtype=...)`` does. A read failing halfway (a damaged file, an I/O error) reaches every
rank before the next group is sent, instead of leaving them waiting until ``dist.timeout``.
"""

import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .._utils.tied import tied_names
from ..distributed import env
from ..distributed.collectives import all_gather_object, broadcast, raise_on_any_rank

__all__ = ["load_weights", "local_slices"]

_GROUP_BYTES = 1 << 30  # what rank 0 reads before sending it: one group of tensors
_WHAT = "loading dist.fsdp.init_from"


class _Spec(NamedTuple):
    """A checkpoint tensor as its file describes it, without its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype | str  # a safetensors dtype name torch does not know stays a string
    file: str


def load_weights(model: nn.Module, path: str) -> None:
    """Fill ``model``'s (possibly sharded) tensors from the checkpoint ``path``. Every rank must call it.

    Only rank 0 reads ``path``; nothing is loaded before every tensor's shape and dtype were compared with the
    model's on every rank (see [Note: init_from checks]).

    Raises:
        ValueError: on every rank: rank 0 cannot read ``path``; the checkpoint lacks a tensor of the model or
            holds one in another shape, or in another dtype that is not a floating-point one converted to
            the model's; a read fails while loading.
    """
    if not env.is_distributed() and not os.path.exists(path):
        raise ValueError(f"dist.fsdp.init_from={path!r} does not exist; give a .pth file or an HF directory")
    # what every rank holds (under a pipeline, each rank its own stages): rank 0 reads and checks for all
    wanted = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    aliases = tied_names(model.named_parameters(remove_duplicate=False))
    everyone = all_gather_object((wanted, aliases))
    read, sources, groups, error = None, {}, [], None
    if env.rank() == 0 and not os.path.exists(path):
        error = f"dist.fsdp.init_from={path!r} does not exist on rank 0; put it where rank 0 can read it (the other "
        error += "ranks may lack it: rank 0 then sends each tensor)"
    elif env.rank() == 0:
        try:
            specs, read = _open_source(path)
            sources, error = _check(everyone, specs, path)
            groups = _groups(sources, specs) if error is None else []
        except Exception as exc:  # shared below, so that no rank waits for a rank 0 that gave up
            error = _unreadable(path, exc)
    raise_on_any_rank(error, what=_WHAT, error_type=ValueError)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=env.is_distributed(), strict=False)
    for keys in broadcast(groups if env.rank() == 0 else None):
        state, key = {}, None
        if read is not None:
            try:
                for key in keys:
                    state[key] = read(sources[key])
            except Exception as exc:
                error = _unreadable(path, exc, where=f" at {key}")
        raise_on_any_rank(error, what=_WHAT, error_type=ValueError)
        set_model_state_dict(model, state, options=options)


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


def _open_source(path: str) -> tuple[dict[str, _Spec], Callable[[str], torch.Tensor]]:
    """Every tensor of a checkpoint (shape, dtype, file) and a reader of one whole tensor; no data is read."""
    if not os.path.isdir(path):
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        state = data.get("model", data) if isinstance(data, dict) else {}
        specs = {k: _Spec(tuple(v.shape), v.dtype, path) for k, v in state.items() if isinstance(v, torch.Tensor)}
        return specs, state.__getitem__
    from safetensors import safe_open
    from safetensors.torch import _TYPES

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
        specs[key] = _Spec(tuple(piece.get_shape()), _TYPES.get(piece.get_dtype(), piece.get_dtype()), file)
    return specs, lambda key: handles[files[key]].get_tensor(key)


def _converts(source: torch.dtype | str, target: torch.dtype) -> bool:
    """Whether a checkpoint tensor of dtype ``source`` loads into a model tensor of dtype ``target``."""
    if source == target:
        return True
    return isinstance(source, torch.dtype) and source.is_floating_point and target.is_floating_point


def _describe(shape: tuple[int, ...], dtype: torch.dtype | str) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"


def _check(everyone: list[tuple[dict, dict]], specs: dict[str, _Spec], path: str) -> tuple[dict[str, str], str | None]:
    """Each state_dict key of any rank -> the key to read it from (a tied weight may be stored once), and the
    error text for the first tensor the checkpoint lacks or holds in a shape or dtype that does not fit."""
    sources, missing, differ = {}, [], []
    for wanted, aliases in everyone:
        for key, (shape, dtype) in wanted.items():
            if key in sources or key in missing:  # the ranks of one stage hold the same keys
                continue
            source = key if key in specs else aliases.get(key, key)
            if source not in specs:
                missing.append(key)
                continue
            sources[key], spec = source, specs[source]
            if spec.shape != shape or not _converts(spec.dtype, dtype):
                differ.append((key, source, spec, shape, dtype))
    if missing:
        return sources, f"dist.fsdp.init_from={path!r} lacks {len(missing)} tensor(s) of the model, first: {missing[0]}"
    if not differ:
        return sources, None
    key, source, spec, shape, dtype = differ[0]
    stored = f" (stored as {source})" if source != key else ""
    more = f"; {len(differ) - 1} more differ, next: {differ[1][0]}" if len(differ) > 1 else ""
    return sources, (
        f"dist.fsdp.init_from={path!r}: {key}{stored} is {_describe(spec.shape, spec.dtype)} in {spec.file} but "
        f"{_describe(shape, dtype)} in the model{more}; load a checkpoint of this model, or "
        "build the model from the checkpoint's config (only a floating-point dtype may differ: it is converted)"
    )


def _groups(sources: dict[str, str], specs: dict[str, _Spec]) -> list[list[str]]:
    """The model's keys in groups that rank 0 reads and sends at once: from one file, about ``_GROUP_BYTES``."""
    groups: list[list[str]] = []
    size, file = 0, None
    for key in sorted(sources, key=lambda k: specs[sources[k]].file):
        spec = specs[sources[key]]
        num_bytes = torch.Size(spec.shape).numel() * spec.dtype.itemsize
        if not groups or spec.file != file or size + num_bytes > _GROUP_BYTES:
            groups.append([])
            size, file = 0, spec.file
        groups[-1].append(key)
        size += num_bytes
    return groups


def _unreadable(path: str, exc: Exception, *, where: str = "") -> str:
    return f"dist.fsdp.init_from={path!r} cannot be read{where}: {type(exc).__name__}: {exc}"
