"""The native sharded checkpoint: ``save_checkpoint`` / ``load_checkpoint`` on torch.distributed.checkpoint.

Every rank writes its own shards in parallel, and a checkpoint loads at any world size (DCP
reshards DTensors on load). ``resume_latest`` is the one-line restart. Layout of ``directory``::

    checkpoint-1/        complete checkpoints (DCP files + .metadata + checksums.json)
    checkpoint-2/
    .checkpoint-3.incomplete/   being written; never loaded, removed by the next save
    latest               the tag of the newest complete checkpoint, replaced atomically

[Note: checkpoint atomicity] A checkpoint is written under ``.<tag>.incomplete``; once every rank has
finished, its checksums are recorded (see [Note: checkpoint checksums] in ``torchacc._checksums``), it
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
``torchacc._safe_load``).
"""

import os
import shutil
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._utils.logging import warn_once
from ..data import ShardedDataLoader
from ..dist import env
from ..distributed.collectives import broadcast, raise_on_any_rank
from . import _checksums, _dir
from ._safe_load import SafeLoadPlanner, SafeReader, UnsafeFileError, decode, encode
from .files import describe_os_error
from .optimizer import load_optim_state_dict, optim_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "resume_latest"]

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
            os.makedirs(os.path.join(directory, f".{tag}.incomplete"))
            _dir.write_marker(os.path.join(directory, f".{tag}.incomplete"), tag)
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or directory)
    raise_on_any_rank(error, what=what)
    tag = broadcast(tag, src=0)
    staging, final = os.path.join(directory, f".{tag}.incomplete"), os.path.join(directory, tag)

    state: dict[str, Any] = {f"model/{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        osd = optim_state_dict(model, optimizer)
        for name, values in osd["state"].items():
            for key, value in values.items():
                state[f"optim/{name}/{key}"] = value
        state["optim_param_groups"] = encode(osd["param_groups"])
    for key, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
        if obj is not None:
            state[key] = encode(obj.state_dict())
    state[f"extra/rank-{env.rank()}"] = encode(dict(extra or {}))
    state["torchacc"] = encode({"world_size": env.world_size(), "format": FORMAT})
    error = write_staging(state, staging)
    if error is not None:
        if env.rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"{what} failed: {error}; nothing was saved and '{LATEST}' is unchanged")

    error = None
    if env.rank() == 0:
        try:
            _dir.publish(directory, tag, staging, final)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            error = describe_os_error(exc, exc.filename or final)
    raise_on_any_rank(error, what=what)
    return final


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


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest complete checkpoint under ``directory``, or None if there is none."""
    pointer = os.path.join(os.fspath(directory), LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        tag = f.read().strip()
    # An interrupted re-save of the same tag leaves the previous version under .<tag>.replaced.
    for name in (tag, f".{tag}.replaced"):
        path = os.path.join(os.fspath(directory), name)
        if tag and os.path.isfile(os.path.join(path, ".metadata")):
            return path
    return None


def resume_latest(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any = None,
    dataloader: ShardedDataLoader | None = None,
    verify: bool = True,
    weights_only: bool = True,
) -> dict[str, Any] | None:
    """Load the newest complete ``save_checkpoint`` checkpoint under ``directory``, if there is one.

    The restart half of a training script: call it every time the script starts (every rank), after
    ``accelerate()`` and building the optimizer; under ``torchrun --max-restarts=N`` a crashed job then
    continues from its last complete checkpoint, with the data position restored.

    Args:
        directory: the root given to ``save_checkpoint`` (it need not exist yet).
        model, optimizer, scheduler, dataloader: filled in place, as in ``load_checkpoint``.
        verify: check every file's CRC-32 against the checksums recorded at save.
        weights_only: as in ``load_checkpoint``.

    Returns:
        The ``extra`` dict of the loaded checkpoint, or None when ``directory`` holds no checkpoint yet.

    Raises:
        FileNotFoundError: ``latest`` names a checkpoint that is missing or incomplete.
        ValueError: as ``load_checkpoint`` (a damaged file, a model that does not match).

    Example:
        >>> extra = torchacc.resume_latest("ckpt", model, optimizer, dataloader=loader) or {}
        >>> start = extra.get("step", 0)
    """
    path = require_latest(directory)
    if path is None:
        return None
    return load_checkpoint(
        path,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataloader=dataloader,
        verify=verify,
        weights_only=weights_only,
    )


def require_latest(directory: str | os.PathLike[str]) -> str | None:
    """``latest_checkpoint``, but a ``latest`` naming a missing or incomplete checkpoint raises FileNotFoundError."""
    directory = os.fspath(directory)
    path = latest_checkpoint(directory)
    pointer = os.path.join(directory, LATEST)
    if path is None and os.path.isfile(pointer):
        with open(pointer) as f:
            tag = f.read().strip()
        # Starting afresh here would let the new run's saves (and rotation) bury the old checkpoints.
        raise FileNotFoundError(
            f"{pointer} names {tag!r}, which is not a complete checkpoint in {directory!r}; restore it, or "
            "load an earlier checkpoint-N explicitly with torchacc.load_checkpoint"
        )
    return path


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    dataloader: ShardedDataLoader | None = None,
    verify: bool = True,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint``, at any world size. Every rank must call it.

    Args:
        path: a checkpoint directory, or the root passed to ``save_checkpoint`` (its ``latest`` is loaded).
        model, optimizer, scheduler, dataloader: filled in place; each must have been saved.
        verify: check every file's CRC-32 against the checksums recorded at save (the ranks share the reading);
            False checks only the sizes.
        weights_only: load without running code from the files (see [Note: safe loading] in
            ``torchacc._safe_load``); False only for checkpoints you trust that hold other objects (numpy
            arrays in ``extra``) or were written by torchacc before format 2.

    Returns:
        The ``extra`` dict this rank saved (see [Note: per-rank extra]).

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        ValueError: a missing, truncated or corrupt file (named), the checkpoint lacks something asked for,
            holds keys this model does not have, or holds objects that would run code (with ``weights_only``).
    """
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(
                f"no complete checkpoint at {path!r} (no .metadata, and no '{LATEST}' pointer to one); "
                "pass the directory given to save_checkpoint or one of its checkpoint-N subdirectories"
            )
        path = latest
    what = f"load_checkpoint({path!r})"
    _checksums.verify(path, full=verify, what=what)
    reader = SafeReader(path, weights_only=weights_only)
    try:
        metadata = reader.read_metadata()
        saved = metadata.state_dict_metadata
    except UnsafeFileError:
        raise
    except Exception as exc:
        raise ValueError(
            f"{os.path.join(path, '.metadata')}: unreadable ({type(exc).__name__}: {exc}); the checkpoint is damaged: "
            "restore the file or load an earlier checkpoint"
        ) from None
    state: dict[str, Any] = {f"model/{k}": v for k, v in model.state_dict().items()}
    missing = sorted(k.removeprefix("model/") for k in state if k not in saved)
    unexpected = sorted(k.removeprefix("model/") for k in saved if k.startswith("model/") and k not in state)
    if missing or unexpected:
        raise ValueError(f"{path}: the model does not match the checkpoint: missing {missing}, unexpected {unexpected}")
    params = dict(model.named_parameters())
    if optimizer is not None:
        _require(saved, "optim_param_groups", path, "optimizer")
        for key, meta in saved.items():
            if key.startswith("optim/") and isinstance(meta, TensorStorageMetadata):
                name, _, state_key = key.removeprefix("optim/").rpartition("/")
                state[key] = _template(params.get(name), meta, name, path)
        state["optim_param_groups"] = None
    for key, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
        if obj is not None:
            _require(saved, key, path, key)
            state[key] = None
    extra_key = _extra_key(saved, path)
    state[extra_key] = None
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(weights_only=weights_only))
    except CheckpointException as exc:  # raised on every rank
        detail = _dir.find_short_file(path, metadata) or _dir.describe_failure(exc, path)
        raise ValueError(f"{what} failed: {detail}") from None

    model.load_state_dict({k.removeprefix("model/"): v for k, v in state.items() if k.startswith("model/")})
    if optimizer is not None:
        groups = decode(state["optim_param_groups"], weights_only=weights_only, what=f"{path}: optimizer groups")
        osd: dict[str, Any] = {"state": {}, "param_groups": groups}
        for key, value in state.items():
            if key.startswith("optim/"):
                name, _, state_key = key.removeprefix("optim/").rpartition("/")
                osd["state"].setdefault(name, {})[state_key] = value
        load_optim_state_dict(model, optimizer, osd)
    for key, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
        if obj is not None:
            obj.load_state_dict(decode(state[key], weights_only=weights_only, what=f"{path}: {key} state"))
    return decode(state[extra_key], weights_only=weights_only, what=f"{path}: extra")


def _extra_key(saved: dict[str, Any], path: str) -> str:
    """The entry holding this rank's ``extra`` (see [Note: per-rank extra])."""
    own = f"extra/rank-{env.rank()}"
    if own in saved or "extra" in saved:
        return own if own in saved else "extra"  # "extra": format 1, one value for every rank
    if "extra/rank-0" not in saved:
        raise ValueError(
            f"{path}: holds no 'extra' entry, so torchacc.save_checkpoint did not write it; load a DCP checkpoint "
            "of your own with torch.distributed.checkpoint.load, or FSDP2Strategy.load_checkpoint"
        )
    warn_once(
        f"{path} was saved by fewer ranks than this job has: the ranks it did not have get rank 0's extra "
        "(RNG states, counters); re-seed them if they must differ"
    )
    return "extra/rank-0"


def _require(saved: dict[str, Any], key: str, path: str, what: str) -> None:
    if key not in saved:
        raise ValueError(f"{path}: no {what} state was saved in this checkpoint; do not pass {what}= to load it")


def _template(param: torch.Tensor | None, meta: TensorStorageMetadata, name: str, path: str) -> torch.Tensor:
    """An empty tensor for DCP to load one optimizer state into, laid out like its parameter."""
    if param is None:
        raise ValueError(f"{path}: optimizer state for {name!r}, which is not a parameter of this model")
    if tuple(meta.size) == tuple(param.shape):
        return torch.zeros_like(param, dtype=meta.properties.dtype)
    return torch.zeros(meta.size, dtype=meta.properties.dtype, device=param.device if meta.size else "cpu")
