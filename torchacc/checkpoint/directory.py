"""The checkpoint root: tags, publication, the ``latest`` pointer, rotation and the one writer. Rank 0 does it all.

[Note: checkpoint atomicity] A checkpoint is written under ``.<tag>.incomplete``; once every rank has finished
and its checksums are recorded, rank 0 renames it to ``<tag>``, and only then moves ``latest`` to it. A crash,
even SIGKILL, at any point leaves ``latest`` naming a complete checkpoint. Re-saving an existing tag first
moves the old one to ``.<tag>.replaced``, which ``latest_checkpoint`` falls back to until the new one is in
place. Leftovers of a killed save are removed (or a ``.replaced`` one restored) by the next save.

[Note: one writer] Two live jobs writing one root would bury each other's checkpoints (a ``kill -9`` of
torchrun leaves its workers running). The first save of a job claims the root in ``WRITER`` (host, pid, the
torchrun run id, a token of this process) and refreshes it every ``HEARTBEAT`` seconds; a later job is refused
while that writer lives. A writer is dead when its process is gone (same host), when its file has not been
refreshed for ``STALE`` seconds, or when it is an earlier attempt of the same torchrun job (a restart; torchrun's
run id "none", which every job launched without ``--standalone`` or ``--rdzv-id`` has, names no job). A claim is
created whole and only if there is none (``os.link``), and a dead writer's file is moved away by one claimant only
(``os.rename``), so two jobs saving at the same moment cannot both take the root.
"""

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from typing import Any

from .._utils import fs
from .._utils.fs import atomic_write_text, remove_stale_temps

__all__ = ["LATEST", "MARKER", "WRITER", "check_tag", "next_tag", "clean_leftovers", "publish", "point_latest"]
__all__ += ["latest_checkpoint", "require_latest", "rotate", "is_marked", "claim_writer"]

LATEST = "latest"
MARKER = "torchacc-checkpoint.json"  # in every save_checkpoint directory: what rotation may delete
WRITER = ".torchacc-writer.json"
HEARTBEAT, STALE = 10.0, 60.0
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


_token = secrets.token_hex(8)
_claimed: set[str] = set()


def _read_writer(path: str) -> dict[str, Any] | None:
    """The claim in ``path`` with its age, None when there is none; an unreadable one (claims are created whole)
    is no live writer's."""
    try:
        with open(path) as f:
            found = json.load(f)
        age = time.time() - os.path.getmtime(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        found, age = None, float("inf")
    return {**found, "age": age} if isinstance(found, dict) else {"age": float("inf")}


def claim_writer(directory: str) -> None:
    """Make this job the one writer of ``directory`` ([Note: one writer]), on rank 0, at every save.

    Raises:
        RuntimeError: another live job writes there; the message names its host and process.
    """
    path = os.path.join(directory, WRITER)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    run_id = "" if run_id == "none" else run_id  # torchrun's id of a job launched without one
    for _ in range(10):  # each pass either claims, refuses, or saw another claimant move first
        other = _read_writer(path)
        if other is not None and other.get("token") == _token:
            break
        if other is not None:
            same_job = bool(run_id) and other.get("run_id") == run_id
            gone = other.get("host") == fs._HOST and not fs._alive(int(other.get("pid", 0)))
            if not (same_job or gone or other["age"] > STALE):
                raise RuntimeError(
                    f"{directory!r} is the checkpoint root of another live job (host {other.get('host')}, pid "
                    f"{other.get('pid')}, alive {other['age']:.0f} s ago), and two writers would bury each other's "
                    f"checkpoints; stop that job first (its workers too, see docs/launching.md, 'Stopping a job'), "
                    f"or save into another directory. A writer that died is ignored after {STALE:.0f} s"
                )
            if not _take_away(path):
                continue
        if _create_claim(path, {"host": fs._HOST, "pid": os.getpid(), "run_id": run_id, "token": _token}):
            break
    else:
        raise RuntimeError(f"could not claim {directory!r} as its one checkpoint writer: other jobs keep claiming it")
    if directory not in _claimed:
        _claimed.add(directory)
        threading.Thread(target=_heartbeat, args=(path,), name="torchacc-writer", daemon=True).start()
        atexit.register(_release, path)


def _take_away(path: str) -> bool:
    """Move a dead writer's claim out of the way; False when another claimant moved it first."""
    aside = fs.temp_path(path)
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    os.remove(aside)
    return True


def _create_claim(path: str, me: dict[str, Any]) -> bool:
    """Create the claim whole, unless one exists (a hard link fails on an existing name); False if one does."""
    staged = fs.temp_path(path)
    fs.atomic_write_text(staged, json.dumps(me))
    try:
        os.link(staged, path)
    except FileExistsError:
        return False
    finally:
        os.remove(staged)
    return True


def _heartbeat(path: str) -> None:
    while not _stop.wait(HEARTBEAT):
        if (_read_writer(path) or {}).get("token") != _token:
            return
        try:
            os.utime(path)
        except OSError:
            return


def _release(path: str) -> None:
    _stop.set()
    if (_read_writer(path) or {}).get("token") == _token:
        with contextlib.suppress(OSError):
            os.remove(path)


_stop = threading.Event()
