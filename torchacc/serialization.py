"""``torchacc.save`` / ``torchacc.load``: TorchAcc's checkpoint file helpers, atomic and verifiable.

[Note: atomic files] A file is written under a temporary name beside its target, flushed to disk,
then renamed over the target, so a crash (or SIGKILL) mid-save never leaves a half-written file
under the final name; temporaries left by a killed save are removed by the next save to that path.

[Note: checksums] ``torch.save`` writes a zip archive that records a CRC-32 of every member, so a
truncated or bit-flipped file is detected by ``verify_file`` without any sidecar file.
"""

import contextlib
import errno
import glob
import os
import pickle
import zipfile
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ._file_ranges import corrupt_member_message, file_crc32
from ._zip import record_table
from .dist import env
from .dist.collectives import raise_on_any_rank

__all__ = ["save", "load", "verify_file", "atomic_write", "atomic_write_text", "publish", "temp_path", "fsync_dir"]
__all__ += ["describe_os_error"]


def save(obj: Any, path: str | os.PathLike[str], master_only: bool = True, global_master: bool = False) -> None:
    """Save ``obj`` with ``torch.save``, TorchAcc style. Every rank must call it.

    Tensors are moved to the CPU. With ``master_only=False`` every rank writes its own file (give
    each rank its own ``path``) and DTensors are saved as this rank's local shard. With
    ``master_only=True`` DTensors are first gathered to full tensors (a collective, hence "every
    rank must call"), so the single file is complete. The ranks meet afterwards, and if any rank
    failed to write, every rank raises.

    Args:
        obj: a tensor or a nested dict/list/tuple holding tensors and plain values.
        path: the file to write, atomically (see [Note: atomic files]).
        master_only: only the master writes (see ``global_master``); False: every rank writes.
        global_master: with ``master_only``, only global rank 0 writes (True) or the first rank of
            every node (False, TorchAcc's default, for node-local disks).

    Raises:
        RuntimeError: some rank could not write (a missing or read-only directory, a full disk); the
            message names the rank, the path and how to fix it. ``path`` keeps its previous content.

    Example:
        >>> torchacc.save({"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()},
        ...               f"ckpt/rank-{rank}-of-{world}-model.pth", master_only=False)
    """
    writes = not master_only or env.is_master_ordinal(local=not global_master)
    data = _to_cpu(obj, gather=master_only, keep=writes)
    error = None
    if writes:
        try:
            atomic_write(path, lambda tmp: torch.save(data, tmp))
        except Exception as exc:  # reported to every rank below instead of hanging them
            error = describe_os_error(exc, path)
    raise_on_any_rank(error, what=f"torchacc.save({os.fspath(path)!r})")


def load(path: str | os.PathLike[str], *, mmap: bool = False, verify: bool = False) -> Any:
    """Load a file written by ``torchacc.save`` (or ``torch.save``) onto the CPU.

    Args:
        path: the file.
        mmap: map tensors from the file instead of reading them (for files larger than RAM).
        verify: check every member's CRC-32 first (reads the whole file once more).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is truncated, corrupt, or not a torch checkpoint; the message names it.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint file at {path!r}")
    if verify:
        verify_file(path)
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:
        raise ValueError(f"{path}: cannot be read as a torch checkpoint (truncated or corrupt?): {exc}") from None


def verify_file(path: str | os.PathLike[str], *, members: Callable[[str], bool] | None = None) -> None:
    """Check that ``path`` is a complete torch checkpoint whose members match their recorded CRC-32.

    Args:
        path: the file.
        members: check only the members whose name this returns True for (default: all).

    Raises:
        ValueError: naming the file and what is wrong (truncated, not a checkpoint, a corrupt member).
    """
    path = os.fspath(path)
    try:
        stored = {name: (offset, size, crc) for offset, (name, size, crc) in record_table(path).items()}
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if members is not None and not members(name):
                    continue
                if name in stored:  # torch's members: read through one reused buffer, no zipfile overhead
                    offset, size, crc = stored[name]
                    if file_crc32(path, offset, size) != crc:
                        raise _CorruptMember(name)
                else:
                    _read_member(archive, name)
    except _CorruptMember as bad:
        raise ValueError(corrupt_member_message(path, bad.args[0])) from None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise ValueError(f"{path}: truncated or not a torch checkpoint ({exc})") from None


class _CorruptMember(Exception):
    pass


def _read_member(archive: zipfile.ZipFile, name: str) -> None:
    try:
        with archive.open(name) as member:
            while member.read(1 << 23):  # zipfile checks the CRC-32 when the member ends
                pass
    except zipfile.BadZipFile:  # a bad CRC-32, or a damaged member header
        raise _CorruptMember(name) from None


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
    for stale in glob.glob(f"{glob.escape(path)}.tmp-*"):
        _remove_quietly(stale)
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


def temp_path(path: str | os.PathLike[str]) -> str:
    """The temporary name ``atomic_write`` uses for ``path`` in this process."""
    return f"{os.fspath(path)}.tmp-{os.getpid()}"


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


def _to_cpu(obj: Any, *, gather: bool, keep: bool) -> Any:
    """Tensors to CPU; DTensors gathered (``gather``) or as local shards. With ``keep=False`` only the
    collectives run and nothing is kept (ranks that do not write still take part in the gathers)."""
    if isinstance(obj, DTensor):
        tensor = obj.full_tensor() if gather else obj.to_local()
        return tensor.detach().cpu() if keep else None
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if keep else None
    if isinstance(obj, dict):
        items = {k: _to_cpu(v, gather=gather, keep=keep) for k, v in obj.items()}
        return type(obj)(items) if keep and type(obj) is not dict else items
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_cpu(v, gather=gather, keep=keep) for v in obj)
    return obj
