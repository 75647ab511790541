"""Saving torchacc checkpoints on torch.distributed.checkpoint: ``save_checkpoint``, in the foreground or not.

Every rank writes its own shards in parallel (``writing.py``), and a checkpoint loads at any world size (DCP
reshards DTensors on load; ``dcp_load.py``). Layout of a root: ``checkpoint-1/``, ``checkpoint-2/`` (DCP
files, ``.metadata``, ``checksums.json``, the marker), ``.checkpoint-3.incomplete/`` while written, ``latest``
(the newest complete tag) and the writer's claim; see the notes in ``directory.py``.

[Note: per-rank extra] DCP keeps one copy of each non-tensor entry, so ``extra`` and the random states are
kept under one key per rank (``extra/rank-<r>``, ``rng/rank-<r>``): every rank gets back what it saved.

[Note: pipeline checkpoints] Under pipeline parallelism each rank saves its stages' tensors under the plain
model's names, and DCP puts them together: the checkpoint holds the whole model, and loads at any layout. The
optimizer's param groups (one non-tensor entry) are merged over the stages before saving (each group's parameter
names in stage order), and a pipelined model loading a checkpoint takes its own stages' parameters from them.
"""

import os
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from .._utils.fs import describe_os_error
from ..distributed import env
from ..distributed.collectives import broadcast, raise_on_any_rank
from ..parallel.accelerated import accelerated_state
from . import directory, storage
from .optimizer import optim_state_dict
from .rng import get_rng_state
from .writing import save_dcp, wait_for_save

__all__ = ["save_checkpoint", "save_state", "layout_of", "gather_stages", "FORMAT", "LATEST"]

LATEST = directory.LATEST
FORMAT = "torchacc-dcp/2"  # 1: non-tensor entries pickled, one extra for all ranks


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    dataloader: Any = None,
    extra: dict[str, Any] | None = None,
    tag: str | None = None,
    keep: int | None = None,
    blocking: bool = True,
) -> Any:
    """Save model, optimizer, scheduler, data position, random states and ``extra`` as one sharded checkpoint.

    Every rank must call it. See [Note: checkpoint atomicity] in ``directory.py``.

    Args:
        directory: the checkpoint root; created if missing. One job writes it at a time ([Note: one writer]).
        model: the accelerated model (any FSDP/TP/DDP model: its state goes through torch's state-dict API).
        optimizer: its optimizer (state keyed by parameter names).
        scheduler: anything with ``state_dict()``/``load_state_dict()`` (an LR scheduler).
        dataloader: the loader returned by ``accelerate()``; its position (epoch, batches consumed) is saved.
        extra: values to keep (step counters...): tensors, containers, numbers and strings; each rank keeps its
            own (see [Note: per-rank extra]) and gets it back from ``load_checkpoint``.
        tag: the checkpoint's name; default ``checkpoint-<n+1>``.
        keep: once this checkpoint is published, delete the oldest of the checkpoints ``save_checkpoint`` wrote
            here beyond ``keep`` (never ``latest``'s, nor one being written; other folders are left alone).
        blocking: False returns at once with a ``SaveHandle`` while the files are written in the background
            ([Note: saves in the background] in ``writing.py``); the checkpoint holds the state at the call.

    Returns:
        The path of the new checkpoint, or with ``blocking=False`` a handle whose ``wait()`` returns it.

    Raises:
        ValueError: a bad argument (the same on every rank, before anything is written).
        RuntimeError: some rank failed to write (the message names the rank, the path and the cause), or another
            job writes ``directory``; nothing becomes ``latest`` and the previous checkpoint is intact.

    Example:
        >>> torchacc.save_checkpoint("ckpt", model=model, optimizer=opt, dataloader=loader, extra={"step": step})
    """
    options = {"optimizer": optimizer, "scheduler": scheduler, "dataloader": dataloader, "extra": extra}
    return save_state(directory, model=model, tag=tag, keep=keep, blocking=blocking, **options)


def save_state(
    root: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    dataloader: Any,
    extra: dict[str, Any] | None,
    tag: str | None,
    keep: int | None,
    max_bytes: float = float("inf"),
    blocking: bool,
) -> Any:
    """``save_checkpoint``, whose rotation also keeps the checkpoints under ``max_bytes`` (``save_ckpt``'s)."""
    _check_args(model, scheduler, dataloader, extra, keep)
    directory.check_tag(tag)
    root = os.fspath(root)
    what = f"save_checkpoint({root!r})"
    # extra differs between ranks, so a bad one may show on one rank only: every rank must hear of it
    raise_on_any_rank(_extra_problem(extra), what=what, error_type=ValueError)
    wait_for_save()  # its publication may move latest and rotate
    error = None
    if env.rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            directory.claim_writer(root)
            directory.clean_leftovers(root)
            tag = tag or directory.next_tag(root)
            directory.check_own(root, tag)  # re-saving a tag replaces only what torchacc wrote
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or root)
        except RuntimeError as exc:
            error = str(exc)
    raise_on_any_rank(error, what=what)
    tag = broadcast(tag, src=0)

    state: dict[str, Any] = {f"model/{k}": v for k, v in get_model_state_dict(model).items()}
    if optimizer is not None:
        osd = optim_state_dict(model, optimizer)
        state.update({f"optim/{name}/{k}": v for name, values in osd["state"].items() for k, v in values.items()})
        state["optim_param_groups"] = storage.encode(_merged_groups(model, osd["param_groups"]))
    for key, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
        if obj is not None:
            state[key] = storage.encode(obj.state_dict())
    # what is not a tensor must load back with weights_only=True, or a resume would fail at every restart
    problem = next(filter(None, (_unloadable(state[k], name) for k, name in _DECODED.items() if k in state)), None)
    raise_on_any_rank(problem, what=what, error_type=ValueError)
    state[f"extra/rank-{env.rank()}"] = storage.encode(dict(extra or {}))
    state[f"rng/rank-{env.rank()}"] = storage.encode(get_rng_state())
    state["torchacc"] = storage.encode({"world_size": env.world_size(), "format": FORMAT, "layout": layout_of(model)})
    final = os.path.join(root, tag)

    def published() -> None:
        directory.point_latest(root, tag)
        if keep is not None:
            directory.rotate(root, keep=keep, newest=final, max_bytes=max_bytes)

    handle = save_dcp(state, final, what=what, tag=tag, on_published=published, blocking=blocking)
    return final if blocking else handle


def layout_of(model: nn.Module) -> str:
    """How the ranks split ``model`` (``"fsdp=2 x tp=2"``): random states are restored only into the same layout."""
    accelerated = accelerated_state(model)
    return f"{env.world_size()} rank(s)" + (f", {accelerated.layout.dims.describe()}" if accelerated else "")


def gather_stages(model: nn.Module, obj: Any) -> list[Any] | None:
    """``obj`` of each pipeline stage of ``model`` (every rank of its pipeline group must call it), or None
    without a pipeline."""
    state = accelerated_state(model)
    if state is None or state.layout.dims.pp == 1 or state.mesh is None:
        return None
    stages: list[Any] = [None] * state.layout.dims.pp
    dist.all_gather_object(stages, obj, group=state.mesh.get_group("pp"))
    return stages


def _merged_groups(model: nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` with the other pipeline stages' parameter names added: see [Note: pipeline checkpoints]."""
    stages = gather_stages(model, groups)
    if stages is None:
        return groups
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


def _check_args(model: Any, scheduler: Any, dataloader: Any, extra: Any, keep: Any) -> None:
    """Raise on arguments that would fail later on some ranks only or half-way through a save."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
        if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            hint = "the loader returned by torchacc.accelerate()" if name == "dataloader" else "an LR scheduler"
            raise ValueError(
                f"{name}= must have state_dict() and load_state_dict(), got {type(obj).__name__}; pass {hint}"
            )
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra= must be a dict of tensors, containers, numbers, strings; got {type(extra).__name__}")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(f"keep={keep!r} must be None (keep every checkpoint) or an int >= 1, the checkpoints to keep")


_DECODED = {"optim_param_groups": "the optimizer state (param_groups)", "scheduler": "the scheduler's state_dict()",
            "dataloader": "the dataloader's state_dict()"}  # fmt: skip


def _extra_problem(extra: dict[str, Any] | None) -> str | None:
    """Why ``extra`` would not load back without ``weights_only=False``, or None (checked on every rank)."""
    try:
        return _unloadable(storage.encode(extra or {}), "extra=")
    except Exception as exc:
        return f"extra= cannot be saved: {type(exc).__name__}: {exc}"


def _unloadable(blob: bytes, what: str) -> str | None:
    """Why the encoded ``blob`` (``what``) would not load back without ``weights_only=False``, or None."""
    try:
        storage.decode(blob, weights_only=True, what=what)
    except storage.UnsafeFileError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        return (
            f"{what} holds values that could not be loaded back without running code"
            f"{f' (found {found.group(1)})' if found else ''}"
            "; keep tensors, containers, numbers and strings (a numpy number: float(value) or int(value); a numpy "
            "array: torch.from_numpy(array); an object: its state as a dict)"
        )
    return None
