"""The checkpoint root: tags, publication, the ``latest`` pointer, rotation (and, from ``one_writer.py``, the one
writer). Rank 0 does it all.

[Note: checkpoint atomicity] A checkpoint is written under ``.<tag>.incomplete``; once every rank has finished
and its checksums are recorded, rank 0 renames it to ``<tag>``, and only then moves ``latest`` to it. A crash,
even SIGKILL, at any point leaves ``latest`` naming a complete checkpoint. Re-saving an existing tag first
moves the old one to ``.<tag>.replaced``, which ``latest_checkpoint`` falls back to until the new one is in
place. Leftovers of a killed save are removed (or a ``.replaced`` one restored) by the next save.
"""

import json
import os
import re
import shutil
from typing import Any

from .._utils import fs
from .._utils.fs import atomic_write_text, remove_stale_temps
from .one_writer import WRITER, claim_writer

__all__ = ["LATEST", "MARKER", "WRITER", "check_tag", "next_tag", "clean_leftovers", "publish", "point_latest"]
__all__ += ["latest_checkpoint", "require_latest", "rotate", "is_marked", "claim_writer", "check_own"]

LATEST = "latest"
MARKER = "torchacc-checkpoint.json"  # in every save_checkpoint directory: what rotation may delete
_TAG = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.(.+)\.(incomplete|replaced)$")


def check_tag(tag: Any) -> None:
    """Raise ValueError unless ``tag`` is a plain directory name that ``latest`` reads back unchanged."""
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
        raise ValueError(
            f"tag={tag!r} is not a plain directory name; use e.g. 'checkpoint-7' (no '/', not starting with '.', "
            f"no surrounding whitespace or control characters, not {LATEST!r})"
        )


def next_tag(directory: str) -> str:
    """``checkpoint-<n+1>`` for the highest ``checkpoint-<n>`` in ``directory``."""
    numbers = [int(m.group(1)) for name in os.listdir(directory) if (m := _TAG.match(name))]
    return f"checkpoint-{max(numbers, default=0) + 1}"


def clean_leftovers(directory: str) -> None:
    """Remove what killed saves left behind; restore a checkpoint moved aside by an interrupted re-save. Only
    folders carrying the marker of their tag count: a user's ``.x.incomplete`` beside them is never touched."""
    remove_stale_temps(os.path.join(directory, LATEST))
    for name in os.listdir(directory):
        if (m := _LEFTOVER.match(name)) and _marker(os.path.join(directory, name)).get("tag") == m.group(1):
            path, target = os.path.join(directory, name), os.path.join(directory, m.group(1))
            if m.group(2) == "replaced" and not os.path.exists(target):
                os.replace(path, target)
            else:
                shutil.rmtree(path)


def check_own(directory: str, tag: str) -> None:
    """Raise RuntimeError when saving ``tag`` would replace a folder torchacc did not write: ``<tag>`` itself, or a
    non-empty ``.<tag>.incomplete`` / ``.<tag>.replaced`` without the marker of ``tag``."""
    for name in (tag, f".{tag}.incomplete", f".{tag}.replaced"):
        path = os.path.join(directory, name)
        foreign = _marker(path).get("tag") != tag and os.path.exists(path)
        if foreign and (name == tag or not os.path.isdir(path) or os.listdir(path)):
            raise RuntimeError(
                f"tag={tag!r}: {path!r} is a folder not written by torchacc (no {MARKER} naming {tag!r}), which "
                "the save would replace; use another tag, or move the folder away"
            )


def write_marker(staging: str, tag: str | None) -> None:
    """Mark a checkpoint directory as written by torchacc (by ``save_checkpoint`` under ``tag``), with a checksum
    manifest that loading must then find."""
    with open(os.path.join(staging, MARKER), "w") as f:
        json.dump({"format": "torchacc-checkpoint/1", "tag": tag, "checksums": True}, f)


def _marker(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, MARKER)) as f:
            found = json.load(f)
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def is_marked(path: str) -> bool:
    """True for a directory ``save_checkpoint`` wrote under its current name: the only ones rotation deletes."""
    return _marker(path).get("tag") == os.path.basename(os.path.normpath(path))


def has_checksums(path: str) -> bool:
    """True for a checkpoint written with a checksum manifest (its marker says so; older ones have none)."""
    return _marker(path).get("checksums") is True


def publish(staging: str, final: str) -> None:
    """Rename the finished ``staging`` to ``final`` ([Note: checkpoint atomicity]); a previous ``final`` waits under
    ``.<name>.replaced`` until the caller has moved ``latest`` and removes it."""
    parent, name = os.path.split(os.path.abspath(final))
    replaced = os.path.join(parent, f".{name}.replaced")
    if os.path.exists(replaced):  # an interrupted swap: the version to move aside, unless final exists
        shutil.rmtree(replaced) if os.path.exists(final) else os.replace(replaced, final)
    if os.path.exists(final):
        os.replace(final, replaced)
    try:
        os.replace(staging, final)
    except OSError:
        if os.path.exists(replaced):
            os.replace(replaced, final)
        raise
    fs.fsync_dir(parent)


def point_latest(directory: str, tag: str) -> None:
    """Move the ``latest`` pointer of ``directory`` to ``tag``, atomically."""
    latest = os.path.join(directory, LATEST)
    try:
        atomic_write_text(latest, tag)
    except OSError as exc:
        exc.filename = exc.filename or latest  # a write() error names no file
        raise


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest complete checkpoint under ``directory``, or None if there is none."""
    pointer = os.path.join(os.fspath(directory), LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        tag = f.read().strip()
    for name in (tag, f".{tag}.replaced"):  # an interrupted re-save of the tag leaves it moved aside
        path = os.path.join(os.fspath(directory), name)
        if tag and os.path.isfile(os.path.join(path, ".metadata")):
            return path
    return None


def require_latest(directory: str | os.PathLike[str]) -> str | None:
    """``latest_checkpoint``, but a ``latest`` naming a missing or incomplete checkpoint raises FileNotFoundError."""
    path, pointer = latest_checkpoint(directory), os.path.join(os.fspath(directory), LATEST)
    if path is None and os.path.isfile(pointer):
        with open(pointer) as f:
            tag = f.read().strip()
        # Starting afresh here would let the new run's saves (and rotation) bury the old checkpoints.
        raise FileNotFoundError(
            f"{pointer} names {tag!r}, which is not a complete checkpoint in {os.fspath(directory)!r}; restore it, "
            "or load an earlier checkpoint-N explicitly with torchacc.load_checkpoint"
        )
    return path


def rotate(directory: str, *, keep: int, newest: str, max_bytes: float = float("inf")) -> None:
    """Delete the oldest checkpoints that ``save_checkpoint`` wrote here beyond ``keep`` (or ``max_bytes``).

    Only complete directories carrying the marker under their own name count (a user's folder beside them is
    never touched); ``newest`` (the one ``latest`` names) is never deleted, nor is a checkpoint being written.
    """

    def size(path: str) -> int:
        return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)

    paths = [os.path.join(directory, n) for n in os.listdir(directory) if not n.startswith(".")]
    own = sorted((p for p in paths if os.path.isfile(os.path.join(p, ".metadata")) and is_marked(p)), key=_mtime)
    total = sum(size(p) for p in own) if max_bytes != float("inf") else 0
    for path in own:
        if len(own) <= max(keep, 1) and total <= max_bytes:
            break
        if not os.path.samefile(path, newest):
            total -= size(path) if max_bytes != float("inf") else 0
            shutil.rmtree(path)
            own = [p for p in own if p != path]


def _mtime(path: str) -> float:
    return os.path.getmtime(os.path.join(path, MARKER))
