"""Files written atomically, and what an OS error means for the user.

[Note: atomic files] A file is written under a temporary name beside its target, flushed to disk,
then renamed over the target, so a crash (or SIGKILL) mid-save never leaves a half-written file
under the final name. The temporary name holds the host, the process id and a random part, so writers
of one path on several nodes of a shared file system never touch each other's files: each renames its
own complete file, and the last rename wins. A save removes only temporaries that a dead process of its
own host left behind.
"""

import contextlib
import errno
import glob
import os
import re
import secrets
import socket
from collections.abc import Callable

__all__ = ["atomic_write", "atomic_write_text", "publish", "temp_path", "remove_stale_temps", "fsync_dir"]
__all__ += ["describe_os_error"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], None], *, sync: bool = True) -> None:
    """Call ``write(tmp_path)``, then move the finished file to ``path`` (see [Note: atomic files]).

    Args:
        path: the final name.
        write: writes the complete file to the temporary path it is given.
        sync: fsync the file before the rename (see ``publish``).

    Raises:
        Whatever ``write`` raises; the temporary file is removed and ``path`` is untouched.
    """
    path = os.fspath(path)
    remove_stale_temps(path)
    tmp = temp_path(path)
    try:
        write(tmp)
        publish(tmp, path, sync=sync)
    except BaseException:
        _remove_quietly(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write the small text file ``path`` atomically (see [Note: atomic files])."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)


_HOST = re.sub(r"[^\w.]", "_", socket.gethostname()) or "host"
_TEMP = re.compile(r"\.tmp-(\d+)@(.+)-[0-9a-f]{8}$")


def temp_path(path: str | os.PathLike[str]) -> str:
    """A new temporary name beside ``path``, unique to this host, process and call (see [Note: atomic files])."""
    return f"{os.fspath(path)}.tmp-{os.getpid()}@{_HOST}-{secrets.token_hex(4)}"


def remove_stale_temps(path: str | os.PathLike[str]) -> None:
    """Remove the temporaries of ``path`` that processes of this host left when they died; never another host's."""
    path = os.fspath(path)
    for stale in glob.glob(f"{glob.escape(path)}.tmp-*"):
        found = _TEMP.search(stale[len(path) :])
        if found and found.group(2) == _HOST and not _alive(int(found.group(1))):
            _remove_quietly(stale)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a live process of another user
        return True
    return True


def publish(tmp: str, path: str | os.PathLike[str], *, sync: bool = True) -> None:
    """Flush the finished file ``tmp`` to disk and rename it to ``path`` (and flush the directory entry).

    ``sync=False`` only renames: a crash of the process still never exposes a partial file, but after a
    power cut ``path`` may hold data the disk never received (as after ``torch.save``).
    """
    if sync:
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush ``directory``'s entries (renames, new files) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_os_error(exc: BaseException, path: str | os.PathLike[str]) -> str:
    """One line saying what went wrong writing ``path`` and how to fix it."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device of {parent!r} while writing {path!r} ({exc}); free space and save again"
    if not os.path.isdir(parent):
        existing = parent
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            return f"{existing!r} is a file, not a directory, so {path!r} cannot be written; fix the path"
        return f"the directory {parent!r} does not exist; create it first (os.makedirs) or fix the path {path!r}"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{path!r} is not writable ({exc}); choose a writable directory or fix its permissions"
    return f"{type(exc).__name__} writing {path!r}: {exc}"


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
