"""Offline consolidation and resharding of per-rank checkpoints, streaming and strict.

Runs without a process group or GPU. Every input file is checked before anything is written
(see ``ShardSet``), tensors are rebuilt one at a time from memory-mapped shards, and outputs
appear under their final names only when complete.

Memory: returning the full state needs the checkpoint's size (the result) plus one tensor; writing
straight to a file (``return_state=False``, what the CLI does) needs about one tensor.
"""

import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from ..._utils.fs import atomic_write
from .._format.safetensors_writer import StreamingSafetensorsWriter
from .._format.torch_writer import StreamingTorchWriter, TensorSlot
from ._checks import refuse_output_among_inputs
from .shard_set import ShardSet, TensorItem, canonical_name, get_path

__all__ = [
    "consolidate",
    "consolidate_sharded_model_checkpoints",
    "consolidate_sharded_optimizer_checkpoints",
    "consolidate_dcp",
]

MODEL_PATTERN = "rank-*-of-*-model.pth"
OPTIM_PATTERN = "rank-*-of-*-optim.pth"


def progress_bar(items: list[TensorItem], desc: str, progress: bool | None) -> Iterator[TensorItem]:
    # progress=None lets tqdm decide (shown on a terminal, silent in logs and tests).
    yield from tqdm(items, desc=desc, unit="tensor", disable=None if progress is None else not progress)


def consolidate(
    pattern: str,
    *,
    section: str = "model",
    out: str | os.PathLike[str] | None = None,
    fmt: str = "torch",
    return_state: bool = True,
    verify: bool = True,
    progress: bool | None = None,
    sync_files: bool = True,
) -> dict[str, Any] | None:
    """Rebuild full tensors from the per-rank files matching ``pattern``.

    Args:
        pattern: a glob such as ``"ckpt/rank-*-of-*-model.pth"``.
        section: ``"model"`` or ``"optimizer"``.
        out: write the result here (atomically); None writes nothing.
        fmt: ``"torch"`` (``{section: state}``, readable by ``torch.load``) or ``"safetensors"`` (model only,
            a flat ``name -> tensor`` file).
        return_state: return the full state; False streams straight to ``out`` with memory for about one
            tensor and returns None.
        verify: check every shard's CRC-32 first.
        progress: show a tqdm bar (None: only on a terminal).
        sync_files: fsync ``out`` before it gets its final name, so that even a power cut cannot leave a
            file that looks complete and is not. False leaves the write-back to the kernel, as
            ``torch.save`` and ``shutil.copyfile`` do: faster when the disk is slower than memory, and
            safe whenever the shards are kept (consolidation can be re-run).

    Returns:
        ``{section: full_state}`` keyed by the original names, or None when ``return_state`` is False.

    Raises:
        ValueError: a shard-set problem (see ``ShardSet``), bad arguments or an ``out`` among the shards; nothing
            is written.
    """
    if fmt not in ("torch", "safetensors"):
        raise ValueError(f"fmt={fmt!r} is not supported; use 'torch' or 'safetensors'")
    if not return_state and out is None:
        raise ValueError("return_state=False needs out=: the result must go somewhere")
    if fmt == "safetensors" and section != "model":
        raise ValueError("safetensors holds a flat name -> tensor map; consolidate optimizer state with fmt='torch'")
    # The tensor data's CRC-32 check runs in a thread beside the copying, and ends before any output is published.
    shards = ShardSet(pattern, section=section, verify=verify, check_tensors_later=True)
    aliases = shards.aliases()
    if out is not None:  # from the files, not from the returned state: copying is faster than serializing
        refuse_output_among_inputs(out, shards.paths)
        writer = _write_safetensors if fmt == "safetensors" else _write_torch

        def write(tmp: str) -> None:
            # the copies check the whole records they read, so the checking thread skips those
            with shards.checking_tensors(skip=_records_copied_whole(shards, aliases)):
                writer(shards, tmp, aliases, progress, write_back=sync_files, check_sources=verify)

        atomic_write(out, write, sync=sync_files)
    if not return_state:
        return None
    state = shards.skeleton()
    with shards.checking_tensors():
        for item in progress_bar(shards.items, "consolidate", progress):
            if item not in aliases:
                _set(state, item.out_path, shards.full_tensor(item))
    for item, first in aliases.items():
        _set(state, item.out_path, get_path(state, first.out_path))
    return {section: state}


def _records_copied_whole(shards: ShardSet, aliases: dict[TensorItem, TensorItem]) -> set[tuple[str, str]]:
    """(path, member name) of the source records that writing ``shards`` copies whole."""
    ranges = (shards.byte_ranges(item) or [] for item in shards.items if item not in aliases)
    return {(r.path, r.member) for item_ranges in ranges for r in item_ranges if r.member is not None}


def _set(obj: Any, path: tuple[str, ...], value: Any) -> None:
    get_path(obj, path[:-1])[path[-1]] = value


def plan_slots(
    shards: ShardSet, aliases: dict[TensorItem, TensorItem], meta: dict[str, Any] | None = None
) -> tuple[Any, dict[TensorItem, TensorSlot]]:
    """The output skeleton with a ``TensorSlot`` per tensor; tied tensors share their first one's slot.

    With ``meta`` (a resharded rank's metadata) sharded tensors get that rank's local shape.
    """
    skeleton = shards.skeleton()
    slots: dict[TensorItem, TensorSlot] = {}
    for index, item in enumerate(shards.items):
        shape = item.shape
        if meta is not None and item.meta_key is not None:
            shape = tuple(meta["tensors"][canonical_name(item.meta_key)]["local_shape"])
        slots[item] = TensorSlot(str(index), shape, item.dtype)
    for item in shards.items:
        _set(skeleton, item.out_path, slots[aliases.get(item, item)])
    return skeleton, slots


def _write_torch(
    shards: ShardSet, path: str, aliases: dict[str, str], progress: bool | None, **copy_options: bool
) -> None:
    skeleton, slots = plan_slots(shards, aliases)
    with StreamingTorchWriter(path, {shards.section: skeleton}, **copy_options) as writer:
        for item in progress_bar(shards.items, "consolidate", progress):
            if item not in aliases:
                write_item(writer, slots[item], shards, item)


def write_item(
    writer: StreamingTorchWriter,
    slot: TensorSlot,
    shards: ShardSet,
    item: TensorItem,
    rows: tuple[int, int] | None = None,
    *,
    full: torch.Tensor | None = None,
) -> None:
    """Write ``item``, or its dim-0 ``rows`` [start, stop), to ``slot``: copied file to file where possible,
    else cut from ``full`` (``item`` already rebuilt by the caller) or from ``item`` rebuilt here."""
    row_bytes = math.prod(item.shape[1:]) * item.dtype.itemsize
    start, stop = (rows[0] * row_bytes, rows[1] * row_bytes) if rows else (0, item.num_bytes)
    ranges = None if full is not None else shards.byte_ranges(item, start, stop)
    if ranges is not None:
        writer.copy(slot, ranges)
    else:
        full = shards.full_tensor(item) if full is None else full
        writer.write(slot, full[rows[0] : rows[1]] if rows else full)


def _write_safetensors(
    shards: ShardSet, path: str, aliases: dict[str, str], progress: bool | None, **copy_options: bool
) -> None:
    layout = {item.out_path[0]: (item.shape, item.dtype) for item in shards.items}
    writer = StreamingSafetensorsWriter(path, layout, **copy_options)
    for item in progress_bar(shards.items, "consolidate", progress):
        ranges = shards.byte_ranges(item)
        if ranges is not None:
            writer.copy(item.out_path[0], ranges)
        else:
            writer.write(item.out_path[0], shards.full_tensor(item))
    writer.close()


def consolidate_dcp(
    path: str, *, section: str = "model", out: str, fmt: str = "torch", sync_files: bool = True
) -> None:
    """Write the model (or optimizer) state of the ``save_checkpoint`` checkpoint ``path`` to ``out`` as
    :func:`consolidate` does (``{section: state}`` or flat safetensors), reading one tensor at a time."""
    from ..dcp_load import dcp_source

    layout, read = dcp_source(path, "model/" if section == "model" else "optim/")
    if fmt == "safetensors":

        def write(tmp: str) -> None:
            writer = StreamingSafetensorsWriter(tmp, layout)
            for key in layout:
                writer.write(key, read(key))
            writer.close()

        return atomic_write(out, write, sync=sync_files)
    slots = {key: TensorSlot(str(i), shape, dtype) for i, (key, (shape, dtype)) in enumerate(layout.items())}
    skeleton: dict[str, Any] = dict(slots)
    if section != "model":
        from torch.distributed.checkpoint import load

        from ..storage import SafeLoadPlanner, SafeReader, decode

        box = {"optim_param_groups": None}
        load(box, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=True)
        skeleton = {"state": {}, "param_groups": decode(box["optim_param_groups"], weights_only=True, what=path)}
        for key, slot in slots.items():
            name, _, state_key = key.rpartition("/")
            skeleton["state"].setdefault(name, {})[state_key] = slot

    def write_torch(tmp: str) -> None:
        with StreamingTorchWriter(tmp, {section: skeleton}) as writer:
            for key, slot in slots.items():
                writer.write(slot, read(key))

    atomic_write(out, write_torch, sync=sync_files)


def _shard_glob(ckpt_prefix: str, ckpt_suffix: str, default_out: str, save_path: str) -> tuple[str, str]:
    """TorchAcc's (prefix, suffix) as a glob and the default output: a directory prefix globs inside it."""
    if os.path.isdir(ckpt_prefix):
        return os.path.join(ckpt_prefix, ckpt_suffix), save_path or os.path.join(ckpt_prefix, default_out)
    return ckpt_prefix + ckpt_suffix, save_path or f"{ckpt_prefix}{default_out}"


def consolidate_sharded_model_checkpoints(
    ckpt_prefix: str, ckpt_suffix: str = MODEL_PATTERN, save_path: str = "", save_model: bool = True
) -> dict[str, Any]:
    """TorchAcc's consolidation: merge the shard files ``ckpt_prefix`` + ``ckpt_suffix`` into one state dict.

    Args:
        ckpt_prefix: the directory of the shard files (the glob runs inside it, with or without a trailing
            ``/``), or a path prefix such as ``"ckpt/run1-"``.
        ckpt_suffix: the glob after the prefix, e.g. ``"rank-*-of-*.pth"`` for files written by
            ``torchacc.save(ckpt, directory, master_only=False)``.
        save_path: where to write ``{"model": full_state_dict}``; default ``consolidated.pth`` in the directory
            (``ckpt_prefix + "consolidated.pth"`` for a path prefix, as torch_xla names it).
        save_model: write the file (False only returns it).

    Returns:
        ``{"model": full_state_dict}`` keyed by the original parameter names; it loads into the plain,
        un-accelerated model with ``strict=True``, and into an accelerated one with ``load_state_dict``.

    Raises:
        ValueError: a missing, duplicate or foreign rank, mixed world sizes, a shape or dtype mismatch, a
            truncated or corrupt file; the message names the file and nothing is written.

    Example:
        >>> torchacc.dist.fsdp.consolidate_sharded_model_checkpoints("ckpt", "rank-*-of-*.pth")  # ckpt/consolidated.pth
    """
    pattern, out = _shard_glob(ckpt_prefix, ckpt_suffix, "consolidated.pth", save_path)
    return consolidate(pattern, section="model", out=out if save_model else None)


def consolidate_sharded_optimizer_checkpoints(
    ckpt_prefix: str, ckpt_suffix: str = OPTIM_PATTERN, save_path: str = "", save_optimizer: bool = True
) -> dict[str, Any]:
    """Merge per-rank optimizer shards (``torchacc.optim_state_dict`` saved with shard metadata).

    Returns ``{"optimizer": full_state}`` keyed by parameter names, which
    ``torchacc.load_optim_state_dict`` loads at any world size. Otherwise as
    :func:`consolidate_sharded_model_checkpoints` (default output ``consolidated_optim.pth``).
    """
    pattern, out = _shard_glob(ckpt_prefix, ckpt_suffix, "consolidated_optim.pth", save_path)
    return consolidate(pattern, section="optimizer", out=out if save_optimizer else None)
