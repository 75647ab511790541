"""The directory side of ``save_checkpoint``: arguments, tags, the ``latest`` pointer, publishing, leftovers.

See [Note: checkpoint atomicity] in ``torchacc/checkpoint.py``; all but ``check_save_args`` run on rank 0.
"""

import json
import os
import re
import shutil
from typing import Any

import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from .._utils.fs import atomic_write_text, describe_os_error, fsync_dir, remove_stale_temps
from ._safe_load import UnsafeFileError, decode, encode

__all__ = ["LATEST", "MARKER", "check_save_args", "check_extra", "next_tag", "clean_leftovers", "point_latest"]
__all__ += ["describe_failure", "find_short_file", "swap_in", "write_marker", "is_marked", "fsync_dir"]

LATEST = "latest"
MARKER = "torchacc-checkpoint.json"  # written into every save_checkpoint directory: see is_marked
TAG = re.compile(r"^checkpoint-(\d+)$")
LEFTOVER = re.compile(r"^\.(.+)\.(incomplete|replaced)$")


def check_save_args(model: Any, scheduler: Any, dataloader: Any, extra: Any, tag: Any) -> None:
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
    if tag is not None and (
        not isinstance(tag, str)
        or not tag
        or tag.startswith(".")
        or tag == LATEST
        or "/" in tag
        or os.sep in tag
        or tag != tag.strip()
        or not tag.isprintable()
    ):
        # 'latest' holds the tag as text, read back stripped: "final " would resolve to another checkpoint
        raise ValueError(
            f"tag={tag!r} is not a plain directory name; use e.g. 'checkpoint-7' (no '/', not starting with '.', "
            f"no surrounding whitespace or control characters, not {LATEST!r})"
        )


def check_extra(extra: dict[str, Any] | None) -> str | None:
    """Why ``extra`` would not load back without ``weights_only=False``, or None (checked on every rank)."""
    if not extra:
        return None
    try:
        decode(encode(extra), weights_only=True, what="extra")
    except UnsafeFileError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        kind = f" (found {found.group(1)})" if found else ""
        return (
            f"extra= holds values that could not be loaded back without running code{kind}; keep tensors, "
            "containers, numbers and strings (a numpy array: torch.from_numpy(array); an object: its state as a dict)"
        )
    except Exception as exc:
        return f"extra= cannot be saved: {type(exc).__name__}: {exc}"
    return None


def write_marker(staging: str, tag: str) -> None:
    """Mark a checkpoint directory as written by ``save_checkpoint`` under ``tag`` (rank 0)."""
    with open(os.path.join(staging, MARKER), "w") as f:
        json.dump({"format": "torchacc-checkpoint/1", "tag": tag}, f)


def is_marked(path: str) -> bool:
    """True for a directory ``save_checkpoint`` wrote under its current name: the only ones rotation deletes."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f).get("tag") == os.path.basename(os.path.normpath(path))
    except (OSError, ValueError, AttributeError):
        return False


def next_tag(directory: str) -> str:
    """``checkpoint-<n+1>`` for the highest ``checkpoint-<n>`` in ``directory``."""
    numbers = [int(m.group(1)) for name in os.listdir(directory) if (m := TAG.match(name))]
    return f"checkpoint-{max(numbers, default=0) + 1}"


def clean_leftovers(directory: str) -> None:
    """Remove what killed saves left behind; restore a checkpoint moved aside by an interrupted re-save."""
    remove_stale_temps(os.path.join(directory, LATEST))
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if m := LEFTOVER.match(name):
            target = os.path.join(directory, m.group(1))
            if m.group(2) == "replaced" and not os.path.exists(target):
                os.replace(path, target)
            else:
                shutil.rmtree(path)


def swap_in(staging: str, final: str, replaced: str) -> None:
    """Rename the finished ``staging`` to ``final``. A previous ``final`` is moved to ``replaced`` first (and
    moved back if the rename fails); the caller removes ``replaced`` once nothing points at it. A ``replaced``
    left by an interrupted swap is dropped when ``final`` exists, else it is the version to move aside."""
    if os.path.exists(replaced):
        if os.path.exists(final):
            shutil.rmtree(replaced)
        else:
            os.replace(replaced, final)
    if os.path.exists(final):
        os.replace(final, replaced)
    try:
        os.replace(staging, final)
    except OSError:
        if os.path.exists(replaced):
            os.replace(replaced, final)
        raise


def point_latest(directory: str, tag: str) -> None:
    """Move the ``latest`` pointer of ``directory`` to ``tag``, atomically (rank 0)."""
    latest = os.path.join(directory, LATEST)
    try:
        atomic_write_text(latest, tag)
    except OSError as exc:
        exc.filename = exc.filename or latest  # a write() error names no file
        raise


def describe_failure(exc: BaseException, path: str) -> str:
    """The first underlying error of a failed DCP call (any rank), as one line naming ``path``."""
    prefix = ""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (exc, _) = min(exc.failures.items(), key=lambda item: item[0])
        prefix = f"rank {rank}: "
    if isinstance(exc, OSError):
        return prefix + describe_os_error(exc, exc.filename or path)
    return f"{prefix}{type(exc).__name__}: {exc}"


def find_short_file(path: str, metadata: Any) -> str | None:
    """Name a data file of the DCP checkpoint ``path`` that is missing or shorter than its metadata says."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual is None or actual < size:
            found = "missing" if actual is None else f"{actual} bytes"
            return f"{file}: {found}, but the checkpoint's .metadata needs {size} bytes (truncated?); restore the file"
    return None
