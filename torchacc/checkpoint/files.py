"""``torchacc.save`` / ``torchacc.load``: TorchAcc's checkpoint file helpers, atomic and verifiable (``verify_file``
checks the CRC-32 that ``torch.save``'s zip records for every member: no sidecar file)."""

import os
import pickle
import zipfile
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._utils.fs import atomic_write, describe_os_error
from .._utils.tree import map_tensors
from ..distributed import env
from ..distributed.collectives import all_gather_object, meet, raise_on_any_rank
from ._format.file_ranges import corrupt_member_message, file_crc32
from ._format.zip import record_table
from .state import gather_full
from .storage import refusal, unpickling_detail

__all__ = ["save", "load", "verify_file"]


def save(obj: Any, path: str | os.PathLike[str], master_only: bool = True, global_master: bool = False) -> None:
    """Save ``obj`` with ``torch.save``, TorchAcc style. Every rank must call it.

    Tensors are moved to the CPU. With ``master_only=False`` every rank writes its own file (give
    each rank its own ``path``) and DTensors are saved as this rank's local shard. With
    ``master_only=True`` DTensors are first gathered to full tensors (a collective, hence "every
    rank must call"), so the single file is complete. The ranks meet afterwards, and if any rank
    failed to write, every rank raises.

    Args:
        obj: a tensor or a nest of dicts (``defaultdict`` too), lists, tuples and dataclasses holding tensors
            and plain values, e.g. ``optimizer.state_dict()``.
        path: the file to write, atomically (see [Note: atomic files] in ``torchacc._utils.fs``). With
            ``master_only=False`` it may be a directory (existing, or ending in ``/``): each rank then writes
            ``path/rank-R-of-W.pth``.
        master_only: only the master writes (see ``global_master``); False: every rank writes.
        global_master: with ``master_only``, only global rank 0 writes (True) or the first rank of
            every node (False, TorchAcc's default, for node-local disks).

    Raises:
        ValueError: with ``master_only=False``, several ranks were given the same file (one rank's data
            would be lost); nothing is written.
        RuntimeError: some rank did not call it within ``torchacc.dist.collectives.MEET_TIMEOUT`` seconds (a
            save under ``if rank == 0:``); the message names the ranks.
        RuntimeError: some rank could not write (a missing or read-only directory, a full disk); the
            message names the rank, the path and how to fix it. ``path`` keeps its previous content.

    Example:
        >>> torchacc.save({"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()},
        ...               f"ckpt/rank-{rank}-of-{world}-model.pth", master_only=False)
    """
    path = os.fspath(path)
    if not master_only and (os.path.isdir(path) or path.endswith(("/", os.sep))):
        path = os.path.join(path, f"rank-{env.rank()}-of-{env.world_size()}.pth")  # TorchAcc's directory form
    what = f"torchacc.save({path!r})"
    meet("torchacc.save", hint=_COLLECTIVE_HINT)
    if not master_only:
        _refuse_shared_path(path, what)
    writes = not master_only or env.is_master_ordinal(local=not global_master)

    # A defaultdict (optimizer.state) is written as a dict: weights_only loading cannot rebuild one.
    if master_only:  # every rank takes part in the gathers; only the writers keep the result
        data = gather_full(obj, keep=writes, defaultdict_as_dict=True)
    else:
        data = map_tensors(_local_on_cpu, obj, defaultdict_as_dict=True)
    error = None
    if writes:
        try:
            atomic_write(path, lambda tmp: torch.save(data, tmp))
        except Exception as exc:  # reported to every rank below instead of hanging them
            error = describe_os_error(exc, path)
    raise_on_any_rank(error, what=what)


def _local_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().cpu()


_COLLECTIVE_HINT = (
    "call torchacc.save on every rank, not under `if rank == 0:`: it gathers sharded tensors from every rank "
    "and writes on the master rank by itself (master_only=True); if the ranks reach the save far apart on "
    "purpose, call torchacc.dist.barrier() first"
)


def _refuse_shared_path(path: str, what: str) -> None:
    """Raise on every rank when two ranks would write the same file (the last rename would win silently)."""
    paths = all_gather_object(
        os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    )
    seen: dict[str, int] = {}
    for rank, target in enumerate(paths):
        if target in seen:
            raise ValueError(
                f"{what} failed: ranks {seen[target]} and {rank} would both write {target!r} (master_only=False), "
                "and one rank's data would be lost; give each rank its own file, e.g. "
                "f'ckpt/rank-{torchacc.dist.rank()}-of-{torchacc.dist.world_size()}.pth'"
            )
        seen[target] = rank


def load(path: str | os.PathLike[str], *, mmap: bool = False, verify: bool = False, weights_only: bool = True) -> Any:
    """Load a file written by ``torchacc.save`` (or ``torch.save``) onto the CPU.

    Args:
        path: the file.
        mmap: map tensors from the file instead of reading them (for files larger than RAM).
        verify: check every member's CRC-32 first (reads the whole file once more).
        weights_only: build only tensors, containers, numbers and strings, so that loading cannot run code
            from the file (torch's ``weights_only=True``). Pass False only for a file you trust that holds
            other objects.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is truncated, corrupt, or not a torch checkpoint; or, with ``weights_only``, it
            holds other objects (the message names the opt-in). The message names the file.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint file at {path!r}")
    if verify:
        verify_file(path)
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=weights_only)
    except Exception as exc:  # the unpickler raises anything from KeyError to EOFError on a damaged file
        if weights_only and isinstance(exc, pickle.UnpicklingError) and "GLOBAL" in str(exc):
            raise refusal(path, unpickling_detail(exc)) from None
        detail = " ".join(str(exc).split())[:300]
        raise ValueError(f"{path}: cannot be read as a torch checkpoint (truncated or corrupt?): {detail}") from None


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
