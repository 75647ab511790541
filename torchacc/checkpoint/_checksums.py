"""Size and CRC-32 of every file of a checkpoint directory: recorded at save, checked at load.

[Note: checkpoint checksums] torch.distributed.checkpoint files carry no checksum of their own: a
truncated shard fails deep inside ``torch.load`` without naming the file, and a flipped bit loads
silently. ``record`` writes ``MANIFEST`` (JSON: file name -> [size, crc32]) into a checkpoint's
staging directory after every rank has finished writing and before it is renamed to its final name;
``verify`` checks the files against it. The ranks share the reading: rank r hashes every
world-size-th file of the sorted list, so a check costs each rank 1/N of the checkpoint.
"""

import json
import os
from typing import Any

from .._utils.fs import atomic_write_text, describe_os_error
from ..distributed import env
from ..distributed.collectives import all_gather_object, broadcast, raise_on_any_rank
from ._format.file_ranges import file_crc32

__all__ = ["MANIFEST", "file_crc32", "record", "verify"]

MANIFEST = "checksums.json"
_FORMAT = "torchacc-checksums/1"


def _my_share(names: list[str]) -> list[str]:
    return names[env.rank() :: env.world_size()]


def record(directory: str) -> str | None:
    """Checksum every file in ``directory`` and write ``MANIFEST`` there (rank 0). Every rank must call it.

    Returns:
        None, or the first rank's error (a file it could not read, or rank 0 unable to write the manifest):
        the same text on every rank.
    """
    names = None
    if env.rank() == 0:
        names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    names = [n for n in broadcast(names, src=0) if n != MANIFEST]
    error, entries = None, {}
    for name in _my_share(names):
        path = os.path.join(directory, name)
        try:
            entries[name] = [os.path.getsize(path), file_crc32(path)]
        except OSError as exc:
            error = f"cannot read {path!r} to checksum it: {exc}"
            break
    results = all_gather_object((error, entries))
    errors = [e for e, _ in results if e]
    if not errors and env.rank() == 0:
        files = {name: entry for _, part in results for name, entry in part.items()}
        text = json.dumps({"format": _FORMAT, "files": dict(sorted(files.items()))})
        target = os.path.join(directory, MANIFEST)
        try:
            atomic_write_text(target, text)
        except OSError as exc:
            error = describe_os_error(exc, target)
    if not errors:
        errors = [e for e in all_gather_object(error) if e]
    return errors[0] if errors else None


def _read_manifest(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        files = data["files"]
        if data.get("format") != _FORMAT or not isinstance(files, dict):
            raise ValueError(f"not a {_FORMAT} manifest")
        return files
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: unreadable checksum manifest ({exc}); the checkpoint is damaged") from None


def _check_file(path: str, size: int, crc: int, *, full: bool) -> str | None:
    """What is wrong with one file, or None."""
    fix = "restore the file from a copy, or load an earlier checkpoint"
    if not os.path.isfile(path):
        return f"{path}: missing, but it was written at save ({MANIFEST} lists it); {fix}"
    actual = os.path.getsize(path)
    if actual != size:
        return f"{path}: {actual} bytes, but {size} were written at save (truncated or overwritten); {fix}"
    if full and (got := file_crc32(path)) != crc:
        return f"{path}: CRC-32 {got:08x} differs from {crc:08x} recorded at save (the file is corrupt); {fix}"
    return None


def verify(directory: str, *, full: bool, what: str) -> None:
    """Check the files of ``directory`` against its ``MANIFEST``: sizes, and CRC-32 too when ``full``.

    Every rank must call it. A directory without a manifest (written before checksums existed) passes.

    Raises:
        ValueError: on every rank, naming the first missing, truncated or corrupt file.
    """
    error = None
    try:
        files = _read_manifest(os.path.join(directory, MANIFEST)) or {}
        for name in _my_share(sorted(files)):
            size, crc = files[name]
            error = _check_file(os.path.join(directory, name), size, crc, full=full)
            if error:
                break
    except (OSError, ValueError, TypeError) as exc:
        error = str(exc)
    raise_on_any_rank(error, what=what, error_type=ValueError)
