"""The native sharded checkpoint on torch.distributed.checkpoint: saving (``save_checkpoint``); loading and
resuming are in ``dcp_load.py``.

Every rank writes its own shards in parallel, and a checkpoint loads at any world size (DCP
reshards DTensors on load). ``resume_latest`` is the one-line restart. Layout of ``directory``::

    checkpoint-1/        complete checkpoints (DCP files + .metadata + checksums.json)
    checkpoint-2/
    .checkpoint-3.incomplete/   being written; never loaded, removed by the next save
    latest               the tag of the newest complete checkpoint, replaced atomically

[Note: checkpoint atomicity] A checkpoint is written under ``.<tag>.incomplete``; once every rank has
finished, its checksums are recorded (see [Note: checkpoint checksums] in ``torchacc.checkpoint._checksums``), it
is renamed to ``<tag>``, and only then is ``latest`` moved to it. A crash, even SIGKILL, at any point
leaves ``latest`` naming a complete checkpoint. Re-saving an existing tag first moves the old one to
``.<tag>.replaced``, which ``latest_checkpoint`` falls back to until the new one is in place. A failed
save (a full disk, a directory one rank cannot write) raises on every rank and removes its staging
directory; leftovers of a killed save are removed (or a ``.replaced`` one restored) by the next save.
Only one job may save into a directory at a time.

[Note: per-rank extra] DCP stores one copy of each non-tensor entry, so ``extra`` is kept under one
key per rank (``extra/rank-<r>``): every rank gets back the value it saved (its own RNG states, say).
Loaded at a larger world size, the ranks the checkpoint did not have get rank 0's ``extra``.
Non-tensor entries are encoded so that loading them runs no code (see [Note: safe loading] in
``torchacc.checkpoint._safe_load``).

[Note: pipeline checkpoints] Under pipeline parallelism each rank saves its stages' tensors under the plain
model's names, and DCP puts them together: the checkpoint holds the whole model, and loads at any layout. The
optimizer's param groups (one non-tensor entry) are merged over the stages before saving (each group's parameter
names in stage order), and a pipelined model loading a checkpoint takes its own stages' parameters from them.
"""

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from .._utils.fs import describe_os_error
from ..data import ShardedDataLoader
from ..distributed import env
from ..distributed.collectives import broadcast, raise_on_any_rank
from ..parallel.accelerated import accelerated_state
from . import _checksums, _dir
from ._safe_load import encode
from .optimizer import optim_state_dict

__all__ = ["save_checkpoint", "save_dcp", "write_staging", "pipeline_group_of", "FORMAT", "LATEST"]

LATEST = _dir.LATEST
FORMAT = "torchacc-dcp/2"  # 1: non-tensor entries pickled, one extra for all ranks


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    dataloader: ShardedDataLoader | None = None,
    extra: dict[str, Any] | None = None,
    tag: str | None = None,
) -> str:
    """Save model, optimizer, scheduler, dataloader position and ``extra`` as one sharded checkpoint.

    Every rank must call it. See [Note: checkpoint atomicity].

    Args:
        directory: the checkpoint root; created if missing.
        model: the accelerated model.
        optimizer: its optimizer (state keyed by parameter names).
        scheduler: anything with ``state_dict()``/``load_state_dict()`` (an LR scheduler).
        dataloader: the loader returned by ``accelerate()``; its position (epoch, batches consumed) is saved.
        extra: values to keep (step counters, RNG states...): tensors, containers, numbers and strings; each
            rank keeps its own (see [Note: per-rank extra]) and gets it back from ``load_checkpoint``.
        tag: the checkpoint's name; default ``checkpoint-<n+1>``.

    Returns:
        The path of the new checkpoint.

    Raises:
        ValueError: a bad argument (the same on every rank, before anything is written).
        RuntimeError: some rank failed to write (the message names the rank, the path and the cause); nothing
            becomes ``latest``, the staging directory is removed and the previous checkpoint is intact.

    Example:
        >>> torchacc.save_checkpoint("ckpt", model=model, optimizer=opt, dataloader=loader, extra={"step": step})
    """
    _dir.check_save_args(model, scheduler, dataloader, extra, tag)
    directory = os.fspath(directory)
    what = f"save_checkpoint({directory!r})"
    # extra differs between ranks, so a bad one may show on one rank only: every rank must hear of it
    raise_on_any_rank(_dir.check_extra(extra), what=what, error_type=ValueError)
    error = None
    if env.rank() == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            _dir.clean_leftovers(directory)
            tag = tag or _dir.next_tag(directory)
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or directory)
    raise_on_any_rank(error, what=what)
    tag = broadcast(tag, src=0)
    final = os.path.join(directory, tag)

    state: dict[str, Any] = {f"model/{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        osd = optim_state_dict(model, optimizer)
        for name, values in osd["state"].items():
            for key, value in values.items():
                state[f"optim/{name}/{key}"] = value
        state["optim_param_groups"] = encode(_merged_groups(model, osd["param_groups"]))
    for key, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
        if obj is not None:
            state[key] = encode(obj.state_dict())
    state[f"extra/rank-{env.rank()}"] = encode(dict(extra or {}))
    state["torchacc"] = encode({"world_size": env.world_size(), "format": FORMAT})
    save_dcp(
        state,
        final,
        what=what,
        marker=tag,
        on_published=lambda: _dir.point_latest(directory, tag),
        unchanged=f"'{LATEST}' is unchanged",
    )
    return final


def pipeline_group_of(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group of ``model``'s pipeline (the ranks holding its other stages), or None without one."""
    state = accelerated_state(model)
    if state is None or state.layout.dims.pp == 1 or state.mesh is None:
        return None
    return state.mesh.get_group("pp")


def _merged_groups(model: nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` with the other pipeline stages' parameter names added: see [Note: pipeline checkpoints]."""
    group = pipeline_group_of(model)
    if group is None:
        return groups
    stages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, groups, group=group)
    merged = [{**g, "params": []} for g in stages[0]]
    for stage in stages:
        if len(stage) != len(merged):
            raise ValueError(
                f"the optimizer has {len(stage)} param groups on one pipeline stage and {len(merged)} on another; "
                "build it the same way on every rank (e.g. torch.optim.AdamW(model.parameters()))"
            )
        for into, g in zip(merged, stage, strict=True):
            into["params"] += g["params"]
    return merged


def save_dcp(
    state: dict[str, Any],
    final: str,
    *,
    what: str,
    marker: str | None = None,
    on_published: Callable[[], None] | None = None,
    unchanged: str = "the previous version is intact",
) -> None:
    """Write ``state`` as a DCP checkpoint directory ``final``, atomically. Every rank must call it.

    The one DCP save path (see [Note: checkpoint atomicity]): rank 0 creates ``.<name>.incomplete`` beside
    ``final``, every rank writes its shards there, the checksums are recorded, and rank 0 renames it to
    ``final`` (a previous ``final`` waits under ``.<name>.replaced`` until the new one has its name, and
    ``on_published`` has run). ``marker`` writes save_checkpoint's marker naming that tag.

    Raises:
        RuntimeError: on every rank, naming the rank and cause; nothing is published (``unchanged`` says what
            the caller keeps).
    """
    parent, name = os.path.split(os.path.abspath(final))
    staging, replaced = os.path.join(parent, f".{name}.incomplete"), os.path.join(parent, f".{name}.replaced")
    error = None
    if env.rank() == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
            if marker is not None:
                _dir.write_marker(staging, marker)
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or staging)
    raise_on_any_rank(error, what=what)
    error = write_staging(state, staging)  # the same on every rank
    if error is not None:
        if env.rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"{what} failed: {error}; nothing was saved and {unchanged}")
    error = None
    if env.rank() == 0:
        try:
            _dir.swap_in(staging, final, replaced)
            _dir.fsync_dir(parent)
            if on_published is not None:
                on_published()
            shutil.rmtree(replaced, ignore_errors=True)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            error = describe_os_error(exc, exc.filename or final)
    raise_on_any_rank(error, what=what)


def write_staging(state: dict[str, Any], staging: str) -> str | None:
    """``dcp.save`` ``state`` into the (existing) directory ``staging`` and record its checksums.

    Every rank must call it. Returns None, or the first failure as one line naming the rank and path
    (the same on every rank, so callers can clean up and raise together).
    """
    try:
        dcp.save(state, checkpoint_id=staging)
        return _checksums.record(staging)
    except (Exception, CheckpointException) as exc:  # DCP raises the same failure on every rank
        return _dir.describe_failure(exc, staging)
