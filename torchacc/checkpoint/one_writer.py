"""One writer per checkpoint root: ``claim_writer``, called by rank 0 at every save.

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
import errno
import json
import os
import secrets
import threading
import time
from typing import Any

from .._utils import fs
from .._utils.fs import remove_stale_temps

__all__ = ["WRITER", "claim_writer"]

WRITER = ".torchacc-writer.json"
HEARTBEAT, STALE = 10.0, 60.0

_token = secrets.token_hex(8)
_claimed: set[str] = set()


def _read_writer(path: str) -> dict[str, Any] | None:
    """The claim in ``path`` with its age and text, None when there is none; text that is no claim (being
    created where hard links are missing, or damaged) counts as a writer of unknown host by its age.

    Raises:
        RuntimeError: the claim cannot be read (another user's job may hold the root).
    """
    try:
        with open(path) as f:
            text = f.read()
        age = time.time() - os.path.getmtime(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RuntimeError(f"cannot read {path!r}, the claim of this checkpoint root's writer ({exc})") from None
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    return {**(found if isinstance(found, dict) else {}), "age": age, "_text": text}


def claim_writer(directory: str) -> None:
    """Make this job the one writer of ``directory`` ([Note: one writer]), on rank 0, at every save.

    Raises:
        RuntimeError: another live job writes there; the message names its host and process.
    """
    path = os.path.join(directory, WRITER)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    run_id = "" if run_id == "none" else run_id  # torchrun's id of a job launched without one
    remove_stale_temps(path)
    for _ in range(10):  # each pass either claims, refuses, or saw another claimant move first
        other = _read_writer(path)
        if other is not None and other.get("token") == _token:
            break
        if other is not None:
            same_job = bool(run_id) and other.get("run_id") == run_id
            pid = other.get("pid")
            gone = other.get("host") == fs._HOST and isinstance(pid, int) and not fs._alive(pid)
            if not (same_job or gone or other["age"] > STALE):
                raise RuntimeError(
                    f"{directory!r} is the checkpoint root of another live job (host {other.get('host')}, pid "
                    f"{other.get('pid')}, alive {other['age']:.0f} s ago), and two writers would bury each other's "
                    f"checkpoints; stop that job first (its workers too, see docs/launching.md, 'Stopping a job'), "
                    f"or save into another directory. A writer that died is ignored after {STALE:.0f} s"
                )
            if not _take_away(path, other["_text"]):
                continue
        if _create_claim(path, {"host": fs._HOST, "pid": os.getpid(), "run_id": run_id, "token": _token}):
            break
    else:
        raise RuntimeError(
            f"could not claim {directory!r} as its one checkpoint writer: other jobs kept claiming it ten times in a "
            "row; stop the other jobs saving there, or save into another directory"
        )
    if directory not in _claimed:
        _claimed.add(directory)
        threading.Thread(target=_heartbeat, args=(path,), name="torchacc-writer", daemon=True).start()
        atexit.register(_release, path)


def _take_away(path: str, judged: str) -> bool:
    """Move the dead claim ``judged`` (its text) out of the way; False when another claimant moved first (a claim
    that replaced it meanwhile is put back)."""
    aside = fs.temp_path(path)
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        with open(aside) as f:
            moved = f.read()
    except OSError:
        moved = None
    if moved != judged:
        _put(aside, path)
    fs._remove_quietly(aside)
    return moved == judged


def _create_claim(path: str, me: dict[str, Any]) -> bool:
    """Create the claim whole, unless one exists (a hard link fails on an existing name); False if one does.
    Where the file system has no hard links, an exclusive create (readers may see it half written)."""
    staged = fs.temp_path(path)
    with open(staged, "x") as f:
        f.write(json.dumps(me))
        f.flush()
        os.fsync(f.fileno())
    try:
        return _put(staged, path)
    finally:
        fs._remove_quietly(staged)


def _put(source: str, path: str) -> bool:
    """Give ``path`` the content of ``source`` unless ``path`` exists; False if it does."""
    try:
        os.link(source, path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with open(source) as src, os.fdopen(fd, "w") as f:
        f.write(src.read())
        f.flush()
        os.fsync(f.fileno())
    return True


_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}  # object-store mounts, CIFS


def _heartbeat(path: str) -> None:
    while not _stop.wait(HEARTBEAT):
        try:
            if (_read_writer(path) or {}).get("token") != _token:
                return
            os.utime(path)
        except (OSError, RuntimeError):
            continue  # a passing error (a network file system): the next beat tries again


def _release(path: str) -> None:
    _stop.set()
    with contextlib.suppress(OSError, RuntimeError):
        if (_read_writer(path) or {}).get("token") == _token:
            os.remove(path)


_stop = threading.Event()
