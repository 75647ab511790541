"""The one DCP save: a staging directory, the shards written in the foreground or in the background, publication.

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

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from .._utils.fs import describe_os_error
from .._utils.logging import warn_once
from ..distributed import env
from ..distributed.collectives import all_gather_object, broadcast, raise_on_any_rank
from . import directory, storage

__all__ = ["SaveHandle", "save_dcp", "wait_for_save"]

Written = tuple[str | None, dict[str, list[int]]]  # this rank's error, or the checksums of its files


class SaveHandle:
    """A save that may still be running: ``wait()`` publishes it (every rank must call it) and returns its path."""

    def __init__(self, path: str, written: "Future[Written]", publish: Callable[[Written], None]) -> None:
        self.path, self._written, self._publish, self._done = path, written, publish, False
        self._distributed = env.is_distributed()

    def done(self) -> bool:
        """Whether the files are written (publication still needs ``wait()``)."""
        return self._written.done()

    def wait(self) -> str:
        """Publish the checkpoint once written: checksums, the rename, ``latest``, rotation.

        Raises:
            RuntimeError: on every rank, as a blocking ``save_checkpoint`` would; ``latest`` is unchanged.
        """
        global _in_flight
        if not self._done:
            self._done, _in_flight = True, None
            self._publish(self._written.result())
        return self.path


_in_flight: SaveHandle | None = None


def wait_for_save() -> None:
    """Publish the save in flight, if any (before another save or a load; every rank)."""
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

    Rank 0 creates ``.<name>.incomplete`` beside ``final`` (with the marker naming ``tag``), every rank writes its
    shards and checksums them, then rank 0 writes the manifest, renames the directory to ``final`` and runs
    ``on_published`` (see [Note: checkpoint atomicity] in ``directory.py``); with ``blocking=False`` the writing
    runs in the background ([Note: saves in the background]).

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
            if tag is not None:
                directory.write_marker(staging, tag)
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or staging)
    raise_on_any_rank(error, what=what)

    def publish(written: Written) -> None:
        _publish(written, staging, final, what=what, on_published=on_published, unchanged=unchanged)

    written: Future[Written] = Future()
    if blocking:
        written.set_result(_write(staging, lambda: dcp.save(state, storage_writer=FileSystemWriter(staging))))
        handle = SaveHandle(final, written, publish)
        handle.wait()
        return handle
    writer, group, stager = FileSystemWriter(staging), storage.save_group(), storage.stager()
    upload = dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=stager)
    upload.add_done_callback(lambda done: written.set_result(_write(staging, done.result)))
    _in_flight = SaveHandle(final, written, publish)
    _register_exit_hook()
    return _in_flight


def _write(staging: str, save: Callable[[], Any]) -> Written:
    """Run ``save``, then checksum this rank's files (see [Note: checkpoint checksums] in ``storage.py``)."""
    try:
        save()
        return None, storage.checksum_files(
            staging, [n for n in os.listdir(staging) if n.startswith(f"__{env.rank()}_")]
        )
    except BaseException as exc:  # DCP raises the same failure on every rank
        return storage.describe_failure(exc, staging), {}


def _publish(written: Written, staging: str, final: str, *, what: str, on_published: Any, unchanged: str) -> None:
    results = all_gather_object(written)
    error = next((e for e, _ in results if e), None)
    if error is None and env.rank() == 0:
        try:
            storage.write_manifest(staging, {k: v for _, part in results for k, v in part.items()})
        except OSError as exc:
            error = describe_os_error(exc, exc.filename or staging)
    if (error := broadcast(error, src=0)) is not None:
        if env.rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"{what} failed: {error}; nothing was saved and {unchanged}")
    if env.rank() == 0:
        try:
            directory.publish(staging, final)
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
        atexit.register(_publish_at_exit)  # after init_distributed's hook: runs before the group is destroyed


def _publish_at_exit() -> None:
    # A rank dying of an exception publishes nothing (its peers may not reach this point): the staging directory
    # stays, latest is unchanged, and the next save removes it. See [Note: no teardown on a dying rank] in env.py.
    if _in_flight is None or getattr(sys, "last_value", None) is not None:
        return
    if _in_flight._distributed and not dist.is_initialized():
        warn_once(
            f"the save of {_in_flight.path} was still in flight when the process group was destroyed, so it was not "
            "published; call wait() on the handle of save_checkpoint(blocking=False) before teardown()"
        )
        return
    _in_flight.wait()
