"""The one DCP save: a staging directory, the shards written in the foreground or in the background, publication.

[Note: saves in the background] ``blocking=False`` copies the state to the CPU (pinned memory on CUDA) and
returns; DCP's ``async_save`` writes it in a thread, on a gloo group of its own (sharing the training's group
aborts gloo when both communicate at once), and the same thread finishes the save: each rank checksums its
files, rank 0 writes the manifest, renames the directory and moves ``latest`` (and rotates), and every rank
learns the outcome over that group. ``wait()`` raises it in the foreground, on every rank; a later save, a
load and the exit wait first, so one save is in flight at most. A kill at any point leaves ``latest`` and the
previous checkpoint as they were ([Note: checkpoint atomicity] in ``directory.py``).
"""

import atexit
import os
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from .._utils.fs import describe_os_error
from ..distributed import env
from ..distributed.collectives import raise_on_any_rank
from . import directory, storage

__all__ = ["SaveHandle", "save_dcp", "wait_for_save"]


class SaveHandle:
    """A save that may still be running; ``wait()`` returns its path once it is published."""

    def __init__(self, path: str, outcome: "Future[str | None]") -> None:
        self.path, self._outcome = path, outcome

    def done(self) -> bool:
        """Whether the save is over (published, or failed: ``wait()`` says which)."""
        return self._outcome.done()

    def wait(self) -> str:
        """Wait until the checkpoint is published, and return its path. Every rank must call it.

        Raises:
            RuntimeError: on every rank, as a blocking ``save_checkpoint`` would; ``latest`` is unchanged.
        """
        global _in_flight
        if _in_flight is self:
            _in_flight = None
        error = self._outcome.result()
        if error is not None:
            raise RuntimeError(error)
        return self.path


_in_flight: SaveHandle | None = None


def wait_for_save() -> None:
    """Finish the save in flight, if any (before another save or a load; every rank)."""
    if _in_flight is not None:
        _in_flight.wait()


def save_dcp(
    state: dict[str, Any],
    final: str,
    *,
    what: str,
    tag: str | None = None,
    on_published: Callable[[], None] | None = None,
    unchanged: str = f"'{directory.LATEST}' is unchanged",
    blocking: bool = True,
) -> SaveHandle:
    """Write ``state`` as the DCP directory ``final``, atomically. Every rank must call it.

    Rank 0 creates ``.<name>.incomplete`` beside ``final`` (with the marker, naming ``tag``), every rank writes its
    shards and checksums them, then rank 0 writes the manifest, renames the directory to ``final`` and runs
    ``on_published``; with ``blocking=False`` in the background ([Note: saves in the background]).

    Raises:
        RuntimeError: on every rank, naming the rank and cause; nothing is published (``unchanged`` says what
            the caller keeps).
    """
    global _in_flight
    wait_for_save()
    parent, name = os.path.split(os.path.abspath(final))
    staging, error = os.path.join(parent, f".{name}.incomplete"), None
    if env.rank() == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
            directory.write_marker(staging, tag)
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or staging)
    raise_on_any_rank(error, what=what)
    outcome: Future[str | None] = Future()
    group = None if blocking else storage.save_group()

    def finish(save: Callable[[], Any]) -> None:
        try:
            outcome.set_result(_finish(save, staging, final, what, on_published, unchanged, group))
        except BaseException as exc:  # a failed collective: still an outcome every wait() raises
            outcome.set_result(f"{what} failed: {type(exc).__name__}: {exc}; {unchanged}")

    handle = SaveHandle(final, outcome)
    if blocking:
        finish(lambda: dcp.save(state, storage_writer=FileSystemWriter(staging)))
        handle.wait()
        return handle
    writer, stager = FileSystemWriter(staging), storage.stager()
    upload = dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=stager)
    upload.add_done_callback(lambda done: finish(done.result))
    if _in_flight is None:  # the first: interpreter shutdown joins DCP's thread, then this says how it ended
        atexit.register(_report_at_exit)
    _in_flight = handle
    return handle


def _report_at_exit() -> None:
    if _in_flight is not None and _in_flight.done() and (error := _in_flight._outcome.result()) is not None:
        warnings.warn(f"{error} (a save in the background, not waited for)", stacklevel=1)


def _finish(save: Callable[[], Any], staging: str, final: str, what: str, on_published: Any, unchanged: str,
            group: Any) -> str | None:  # fmt: skip
    """Run ``save``, checksum this rank's files, and (rank 0) publish; return the error, the same on every rank."""
    try:
        save()
        mine = [name for name in os.listdir(staging) if name.startswith(f"__{env.rank()}_")]
        written: tuple[str | None, dict] = (None, storage.checksum_files(staging, mine))
    except BaseException as exc:  # DCP raises the same failure on every rank
        written = (storage.describe_failure(exc, staging), {})
    results = [written]
    if env.is_distributed():
        results = [None] * env.world_size()
        dist.all_gather_object(results, written, group=group)
    error = next((e for e, _ in results if e), None)
    if env.rank() == 0:
        error = _publish(error, results, staging, final, what, on_published, unchanged)
    if env.is_distributed():
        box = [error]
        dist.broadcast_object_list(box, src=0, group=group)
        error = box[0]
    return error


def _publish(error: str | None, results: list, staging: str, final: str, what: str, on_published: Any,
             unchanged: str) -> str | None:  # fmt: skip
    """Rank 0: the manifest, the rename, ``on_published`` (``latest``, rotation); the error message, or None."""
    if error is None:
        try:
            storage.write_manifest(staging, {k: v for _, part in results for k, v in part.items()})
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or staging)
    if error is not None:
        shutil.rmtree(staging, ignore_errors=True)
        return f"{what} failed: {error}; nothing was saved and {unchanged}"
    try:
        directory.publish(staging, final)
        if on_published is not None:
            on_published()
        parent, name = os.path.split(os.path.abspath(final))
        shutil.rmtree(os.path.join(parent, f".{name}.replaced"), ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        where = "failed on 1 rank(s); rank 0:" if env.is_distributed() else "failed:"
        return f"{what} {where} {describe_os_error(exc, exc.filename or final)}"
    return None
