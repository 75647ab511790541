"""The native sharded checkpoint: ``save_checkpoint`` / ``load_checkpoint`` on torch.distributed.checkpoint.

Every rank writes its own shards in parallel, and a checkpoint loads at any world size (DCP
reshards DTensors on load). Layout of ``directory``::

    checkpoint-1/        complete checkpoints (DCP files + .metadata)
    checkpoint-2/
    .checkpoint-3.incomplete/   being written; never loaded
    latest               the tag of the newest complete checkpoint, replaced atomically

[Note: checkpoint atomicity] A checkpoint is written under ``.<tag>.incomplete``, renamed to
``<tag>`` once every rank has finished, and only then is ``latest`` moved to it. A crash at any
point leaves ``latest`` naming the previous complete checkpoint.
"""

import os
import pickle
import re
import shutil
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .data import ShardedDataLoader
from .dist import env
from .dist.collectives import broadcast, raise_on_any_rank
from .optim_state import load_optim_state_dict, optim_state_dict
from .serialization import atomic_write

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint"]

LATEST = "latest"
_TAG = re.compile(r"^checkpoint-(\d+)$")


def _next_tag(directory: str) -> str:
    numbers = [int(m.group(1)) for name in os.listdir(directory) if (m := _TAG.match(name))]
    return f"checkpoint-{max(numbers, default=0) + 1}"


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
        extra: picklable values to keep (step counters, RNG states...); returned by ``load_checkpoint``.
        tag: the checkpoint's name; default ``checkpoint-<n+1>``.

    Returns:
        The path of the new checkpoint.

    Raises:
        RuntimeError: some rank failed to write; nothing becomes ``latest``.

    Example:
        >>> torchacc.save_checkpoint("ckpt", model=model, optimizer=opt, dataloader=loader, extra={"step": step})
    """
    directory = os.fspath(directory)
    error = None
    if env.rank() == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            tag = tag or _next_tag(directory)
            staging = os.path.join(directory, f".{tag}.incomplete")
            shutil.rmtree(staging, ignore_errors=True)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    raise_on_any_rank(error, what=f"save_checkpoint({directory!r})")
    tag = broadcast(tag, src=0)
    staging, final = os.path.join(directory, f".{tag}.incomplete"), os.path.join(directory, tag)

    state: dict[str, Any] = {f"model/{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        osd = optim_state_dict(model, optimizer)
        for name, values in osd["state"].items():
            for key, value in values.items():
                state[f"optim/{name}/{key}"] = value
        state["optim_param_groups"] = _pack(osd["param_groups"])
    for key, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
        if obj is not None:
            state[key] = _pack(obj.state_dict())
    state["extra"] = _pack(dict(extra or {}))
    state["torchacc"] = _pack({"world_size": env.world_size(), "format": "torchacc-dcp/1"})
    dcp.save(state, checkpoint_id=staging)

    error = None
    if env.rank() == 0:
        try:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(staging, final)
            atomic_write(os.path.join(directory, LATEST), lambda tmp: _write_text(tmp, tag))
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    raise_on_any_rank(error, what=f"save_checkpoint({directory!r})")
    return final


def _pack(obj: Any) -> bytes:
    # DCP flattens nested dicts and lists into one key per leaf; pickled bytes stay one opaque entry.
    return pickle.dumps(obj)


def _unpack(blob: Any) -> Any:
    return pickle.loads(blob)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest complete checkpoint under ``directory``, or None if there is none."""
    pointer = os.path.join(os.fspath(directory), LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(os.fspath(directory), f.read().strip())
    return path if os.path.isfile(os.path.join(path, ".metadata")) else None


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    dataloader: ShardedDataLoader | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint``, at any world size. Every rank must call it.

    Args:
        path: a checkpoint directory, or the root passed to ``save_checkpoint`` (its ``latest`` is loaded).
        model, optimizer, scheduler, dataloader: filled in place; each must have been saved.

    Returns:
        The ``extra`` dict that was saved.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        ValueError: the checkpoint lacks something asked for, or holds keys this model does not have.
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
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
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
    state["extra"] = None
    dcp.load(state, checkpoint_id=path)

    model.load_state_dict({k.removeprefix("model/"): v for k, v in state.items() if k.startswith("model/")})
    if optimizer is not None:
        osd: dict[str, Any] = {"state": {}, "param_groups": _unpack(state["optim_param_groups"])}
        for key, value in state.items():
            if key.startswith("optim/"):
                name, _, state_key = key.removeprefix("optim/").rpartition("/")
                osd["state"].setdefault(name, {})[state_key] = value
        load_optim_state_dict(model, optimizer, osd)
    if scheduler is not None:
        scheduler.load_state_dict(_unpack(state["scheduler"]))
    if dataloader is not None:
        dataloader.load_state_dict(_unpack(state["dataloader"]))
    return _unpack(state["extra"])


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
