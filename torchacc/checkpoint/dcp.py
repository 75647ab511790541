"""Saving torchacc checkpoints on torch.distributed.checkpoint: ``save_checkpoint``, in the foreground or not.

Every rank writes its own shards in parallel, and a checkpoint loads at any world size (DCP reshards DTensors
on load; ``dcp_load.py``). Layout of a root: ``checkpoint-1/``, ``checkpoint-2/`` (DCP files, ``.metadata``,
``checksums.json``, the marker), ``.checkpoint-3.incomplete/`` while written, ``latest`` (the newest complete
tag) and the writer's claim; see [Note: checkpoint atomicity] and [Note: one writer] in ``directory.py``.

[Note: per-rank extra] DCP keeps one copy of each non-tensor entry, so ``extra`` and the random states are
kept under one key per rank (``extra/rank-<r>``, ``rng/rank-<r>``): every rank gets back what it saved.

[Note: saves in the background] ``blocking=False`` copies the state to the CPU (pinned memory on CUDA), then
writes it in a thread with DCP's ``async_save`` on a gloo group of its own, and each rank checksums its files
there too. Publication (the manifest, the rename, ``latest``, rotation) needs every rank, so it happens in the
foreground: at ``wait()``, at the next save, at a load, or at exit. One save is in flight at most.
"""

import atexit
import os
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from .._utils.fs import describe_os_error
from ..distributed import env
from ..distributed.collectives import all_gather_object, broadcast, raise_on_any_rank
from . import directory as root
from . import storage
from .optimizer import optim_state_dict
from .rng import get_rng_state

__all__ = ["save_checkpoint", "save_state", "save_dcp", "wait_for_save", "SaveHandle", "FORMAT", "LATEST"]

LATEST = root.LATEST
FORMAT = "torchacc-dcp/2"  # 1: non-tensor entries pickled, one extra for all ranks


class SaveHandle:
    """A save that may still be running: ``wait()`` finishes it (every rank) and returns its path."""

    def __init__(self, path: str, result: "Future[tuple[str | None, dict]]", finish: Callable[[Any], None]) -> None:
        self.path, self._result, self._finish, self._done = path, result, finish, False

    def done(self) -> bool:
        """Whether the files are written (publication still needs ``wait()``)."""
        return self._result.done()

    def wait(self) -> str:
        """Publish the checkpoint once written. Every rank must call it (or a later save or load does).

        Raises:
            RuntimeError: on every rank, as a blocking ``save_checkpoint`` would; ``latest`` is unchanged.
        """
        global _in_flight
        if not self._done:
            self._done, _in_flight = True, None
            self._finish(self._result.result())
        return self.path


_in_flight: SaveHandle | None = None


def wait_for_save() -> None:
    """Finish the save in flight, if any (before another save or a load; every rank)."""
    if _in_flight is not None:
        _in_flight.wait()


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
        blocking: False returns at once with a :class:`SaveHandle` while the files are written in the background
            ([Note: saves in the background]); the checkpoint holds the state at the call.

    Returns:
        The path of the new checkpoint, or with ``blocking=False`` a handle whose ``wait()`` returns it.

    Raises:
        ValueError: a bad argument (the same on every rank, before anything is written).
        RuntimeError: some rank failed to write (the message names the rank, the path and the cause), or another
            job writes ``directory``; nothing becomes ``latest`` and the previous checkpoint is intact.

    Example:
        >>> torchacc.save_checkpoint("ckpt", model=model, optimizer=opt, dataloader=loader, extra={"step": step})
    """
    return save_state(
        directory, model=model, optimizer=optimizer, scheduler=scheduler, dataloader=dataloader, extra=extra,
        tag=tag, keep=keep, blocking=blocking,
    )  # fmt: skip


def save_state(
    directory: str | os.PathLike[str],
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
    root.check_tag(tag)
    directory = os.fspath(directory)
    what = f"save_checkpoint({directory!r})"
    # extra differs between ranks, so a bad one may show on one rank only: every rank must hear of it
    raise_on_any_rank(_extra_problem(extra), what=what, error_type=ValueError)
    wait_for_save()  # its publication may move latest and rotate
    error = None
    if env.rank() == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            root.claim_writer(directory)
            root.clean_leftovers(directory)
            tag = tag or root.next_tag(directory)
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or directory)
        except RuntimeError as exc:
            error = str(exc)
    raise_on_any_rank(error, what=what)
    tag = broadcast(tag, src=0)

    state: dict[str, Any] = {f"model/{k}": v for k, v in get_model_state_dict(model).items()}
    if optimizer is not None:
        osd = optim_state_dict(model, optimizer)
        state.update({f"optim/{name}/{k}": v for name, values in osd["state"].items() for k, v in values.items()})
        state["optim_param_groups"] = storage.encode(osd["param_groups"])
    for key, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
        if obj is not None:
            state[key] = storage.encode(obj.state_dict())
    state[f"extra/rank-{env.rank()}"] = storage.encode(dict(extra or {}))
    state[f"rng/rank-{env.rank()}"] = storage.encode(get_rng_state())
    state["torchacc"] = storage.encode({"world_size": env.world_size(), "format": FORMAT})

    def published() -> None:
        root.point_latest(directory, tag)
        if keep is not None:
            root.rotate(directory, keep=keep, newest=os.path.join(directory, tag), max_bytes=max_bytes)

    final = os.path.join(directory, tag)
    handle = save_dcp(state, final, what=what, tag=tag, on_published=published, blocking=blocking)
    return final if blocking else handle


def save_dcp(
    state: dict[str, Any],
    final: str,
    *,
    what: str,
    tag: str | None = None,
    on_published: Callable[[], None] | None = None,
    unchanged: str = f"'{LATEST}' is unchanged",
    blocking: bool = True,
) -> SaveHandle:
    """Write ``state`` as the DCP directory ``final``, atomically: the one DCP save. Every rank must call it.

    Rank 0 creates ``.<name>.incomplete`` beside ``final`` (with the marker naming ``tag``), every rank writes its
    shards and checksums them, then rank 0 writes the manifest, renames the directory to ``final`` and runs
    ``on_published`` (see [Note: checkpoint atomicity]); with ``blocking=False`` the writing runs in the
    background ([Note: saves in the background]).

    Raises:
        RuntimeError: on every rank, naming the rank and cause; nothing is published (``unchanged`` says what
            the caller keeps).
    """
    global _in_flight
    wait_for_save()
    parent, name = os.path.split(os.path.abspath(final))
    staging = os.path.join(parent, f".{name}.incomplete")
    error = None
    if env.rank() == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
            if tag is not None:
                root.write_marker(staging, tag)
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or staging)
    raise_on_any_rank(error, what=what)

    def finish(written: tuple[str | None, dict]) -> None:
        _publish(written, staging, final, what=what, on_published=on_published, unchanged=unchanged)

    result: Future[tuple[str | None, dict]] = Future()
    if blocking:
        result.set_result(_write(staging, lambda: dcp.save(state, storage_writer=FileSystemWriter(staging))))
        handle = SaveHandle(final, result, finish)
        handle.wait()
        return handle
    writer, group, stager = FileSystemWriter(staging), storage.save_group(), storage.stager()
    upload = dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=stager)
    upload.add_done_callback(lambda done: result.set_result(_write(staging, done.result)))
    _in_flight = SaveHandle(final, result, finish)
    _register_exit_hook()
    return _in_flight


def _write(staging: str, save: Callable[[], Any]) -> tuple[str | None, dict]:
    """Run ``save``, then checksum this rank's files: ``(error or None, {name: [size, crc32]})``."""
    try:
        save()
        mine = sorted(n for n in os.listdir(staging) if n.startswith(f"__{env.rank()}_"))
        return None, storage.checksum_files(staging, mine)
    except BaseException as exc:  # DCP raises the same failure on every rank
        return storage.describe_failure(exc, staging), {}


def _publish(written: tuple, staging: str, final: str, *, what: str, on_published: Any, unchanged: str) -> None:
    results = all_gather_object(written)
    error = next((e for e, _ in results if e), None)
    if error is None and env.rank() == 0:
        try:
            storage.write_manifest(staging, {k: v for _, part in results for k, v in part.items()})
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or staging)
    error = broadcast(error, src=0)
    if error is not None:
        if env.rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"{what} failed: {error}; nothing was saved and {unchanged}")
    if env.rank() == 0:
        try:
            root.publish(staging, final)
            if on_published is not None:
                on_published()
            parent, name = os.path.split(os.path.abspath(final))
            shutil.rmtree(os.path.join(parent, f".{name}.replaced"), ignore_errors=True)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            error = describe_os_error(exc, exc.filename or final)
    raise_on_any_rank(error, what=what)


_exit_hook = False


def _register_exit_hook() -> None:
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_finish_at_exit)  # after init_distributed's: runs before the group is destroyed


def _finish_at_exit() -> None:
    # A rank dying of an exception publishes nothing (its peers may not reach this point): the staging directory
    # stays, latest is unchanged, and the next save removes it. See [Note: no teardown on a dying rank].
    if _in_flight is not None and getattr(sys, "last_value", None) is None:
        _in_flight.wait()


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


def _extra_problem(extra: dict[str, Any] | None) -> str | None:
    """Why ``extra`` would not load back without ``weights_only=False``, or None (checked on every rank)."""
    try:
        storage.decode(storage.encode(extra or {}), weights_only=True, what="extra")
    except storage.UnsafeFileError as exc:
        found = exc.args[0].split("GLOBAL ")[1].split()[0].rstrip(")") if "GLOBAL " in exc.args[0] else ""
        return (
            f"extra= holds values that could not be loaded back without running code{f' (found {found})' * bool(found)}"
            "; keep tensors, containers, numbers and strings (a numpy array: torch.from_numpy(array); an object: its "
            "state as a dict)"
        )
    except Exception as exc:
        return f"extra= cannot be saved: {type(exc).__name__}: {exc}"
    return None
