"""Loading the native sharded checkpoint: ``load_checkpoint``, ``latest_checkpoint`` and ``resume_latest``.

See ``dcp.py`` for the layout of a checkpoint directory, [Note: checkpoint atomicity],
[Note: per-rank extra] and [Note: pipeline checkpoints].
"""

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._utils.logging import warn_once
from ..data import ShardedDataLoader
from ..distributed import env
from . import _checksums, _dir
from ._safe_load import SafeLoadPlanner, SafeReader, UnsafeFileError, decode
from .dcp import LATEST, pipeline_group_of
from .optimizer import load_optim_state_dict

__all__ = ["load_checkpoint", "latest_checkpoint", "resume_latest", "require_latest"]


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
            ``torchacc.checkpoint._safe_load``); False only for checkpoints you trust that hold other objects (numpy
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
    others = _other_stages_keys(model, state)  # held by this model's other pipeline stages
    missing = sorted(k.removeprefix("model/") for k in state if k not in saved)
    unexpected = sorted(
        k.removeprefix("model/") for k in saved if k.startswith("model/") and k not in state and k not in others
    )
    if missing or unexpected:
        raise ValueError(f"{path}: the model does not match the checkpoint: missing {missing}, unexpected {unexpected}")
    params = dict(model.named_parameters())
    if optimizer is not None:
        _require(saved, "optim_param_groups", path, "optimizer")
        for key, meta in saved.items():
            if key.startswith("optim/") and isinstance(meta, TensorStorageMetadata):
                name, _, state_key = key.removeprefix("optim/").rpartition("/")
                if f"model/{name}" in others:
                    continue
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
        if others:  # a pipeline stage takes its own parameters from the groups of every stage
            groups = [{**g, "params": [n for n in g["params"] if f"model/{n}" not in others]} for g in groups]
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


def _other_stages_keys(model: nn.Module, own: dict[str, Any]) -> set[str]:
    """The ``model/`` keys that the other pipeline stages of ``model`` hold (empty without a pipeline)."""
    group = pipeline_group_of(model)
    if group is None:
        return set()
    stages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, sorted(own), group=group)
    return {key for keys in stages for key in keys} - set(own)


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
