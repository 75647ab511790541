"""DCP plug-ins: reading that runs no code, the checksum manifest, and what a save in the background needs.

[Note: safe loading] A pickle can call any function while it is read, so loading a checkpoint from an
untrusted place could run code, and DCP unpickles its ``.metadata`` and its non-tensor entries freely.
torchacc reads ``.metadata`` with an unpickler that builds DCP's metadata classes and nothing else, and every
non-tensor entry with ``torch.load(weights_only=True)``; its own entries (optimizer groups, scheduler, data
position, ``extra``, random states) are ``torch.save`` bytes (:func:`encode`), read back the same way.
``weights_only=False`` restores plain pickle loading for files the caller trusts.

[Note: checkpoint checksums] DCP files carry no checksum: a truncated shard fails deep inside ``torch.load``
without naming the file, and a flipped bit loads silently. Each rank computes the size and CRC-32 of the files
it wrote as soon as they are written (in the background for a save that does not block); rank 0 adds the rest
and writes ``MANIFEST`` into the staging directory before it is published. ``verify`` checks a checkpoint
against it at load, each rank reading every world-size-th file.
"""

import io
import json
import os
import pickle
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from .._utils.fs import atomic_write_text, describe_os_error
from ..distributed import env
from ..distributed.collectives import raise_on_any_rank
from ._format.file_ranges import file_crc32
from .directory import has_checksums

__all__ = ["OPT_IN", "MANIFEST", "UnsafeFileError", "refusal", "encode", "decode", "SafeReader", "SafeLoadPlanner"]
__all__ += ["checksum_files", "write_manifest", "verify", "describe_failure", "find_short_file", "save_group"]
__all__ += ["stager", "unpickling_detail"]

OPT_IN = "weights_only=False"
MANIFEST = "checksums.json"
_MANIFEST_FORMAT = "torchacc-checksums/1"


class UnsafeFileError(ValueError):
    """A file holds pickled objects that loading without ``weights_only=False`` refuses to build."""


def refusal(what: str, detail: str) -> UnsafeFileError:
    """The error for a file that would run code (or build objects outside the allowed set) when loaded."""
    return UnsafeFileError(
        f"{what}: refused to load: it holds pickled objects that could run code ({detail}); torchacc loads "
        f"without running code by default. Only if you trust the file, load it with {OPT_IN} "
        "(see docs/checkpoints.md, 'Loading safely')"
    )


def encode(obj: Any) -> bytes:
    """``obj`` (tensors, containers, numbers, strings) as ``torch.save`` bytes, which :func:`decode` reads back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def decode(blob: Any, *, weights_only: bool, what: str) -> Any:
    """Read back what :func:`encode` wrote, running no code unless ``weights_only`` is False."""
    if not isinstance(blob, bytes):
        raise ValueError(f"{what}: expected encoded bytes, found {type(blob).__name__}; the checkpoint is damaged")
    if not blob.startswith(b"PK\x03\x04"):  # a bare pickle, as torchacc-dcp/1 checkpoints stored it
        if weights_only:
            raise refusal(what, "a bare pickle written by an older torchacc")
        return pickle.loads(blob)
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        raise refusal(what, unpickling_detail(exc)) from None


def unpickling_detail(exc: BaseException) -> str:
    """The global an ``UnpicklingError`` refused (``Unsupported global: GLOBAL numpy...``), or its first line."""
    found = re.search(r"(Unsupported global: GLOBAL [\w.]+|unsupported GLOBAL [\w.]+)", str(exc))
    return found.group(1) if found else str(exc).splitlines()[0]


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: any other global is refused."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if not self.allowed:
            import collections
            import pathlib

            from torch.distributed.checkpoint import filesystem, metadata

            classes = [getattr(metadata, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata")]
            classes += [getattr(metadata, n) for n in ("ChunkStorageMetadata", "TensorProperties", "MetadataIndex")]
            classes += [metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, torch.Size]
            classes += [pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath]
            classes += [collections.OrderedDict, torch.serialization._get_layout]
            type(self).allowed = {(c.__module__, c.__qualname__): c for c in classes}
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")
        return self.allowed[(module, name)]


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read by a restricted unpickler ([Note: safe loading])."""

    def __init__(self, path: str, *, weights_only: bool = True) -> None:
        super().__init__(path)
        self.weights_only = weights_only

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if not self.weights_only:
            return super().read_metadata(*args, **kwargs)
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as exc:
                raise refusal(str(path), str(exc)) from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path}: not DCP metadata (found {type(metadata).__name__}); the checkpoint is damaged")
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=...)``; with ``rebuild``,
    top-level entries the caller gave no template for are rebuilt from the metadata (full tensors on the CPU)."""

    def __init__(self, *, weights_only: bool = True, rebuild: bool = False) -> None:
        super().__init__()
        self.weights_only, self.rebuild = weights_only, rebuild

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if self.rebuild and metadata is not None:
            paths = metadata.planner_data or {}
            for key, m in metadata.state_dict_metadata.items():
                path = paths.get(key, (key,))
                if path[0] not in state_dict:
                    tensor = isinstance(m, TensorStorageMetadata)
                    set_element(state_dict, path, torch.empty(m.size, dtype=m.properties.dtype) if tensor else None)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=self.weights_only)
        except pickle.UnpicklingError as exc:
            raise refusal(f"checkpoint entry {fqn!r}", unpickling_detail(exc)) from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes, after its torch.load(weights_only=False)
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def checksum_files(directory: str, names: list[str]) -> dict[str, list[int]]:
    """``{name: [size, crc32]}`` of the files ``names`` in ``directory`` (see [Note: checkpoint checksums])."""
    return {name: [os.path.getsize(p := os.path.join(directory, name)), file_crc32(p)] for name in names}


def write_manifest(directory: str, entries: dict[str, list[int]]) -> None:
    """Complete ``entries`` with the files nobody checksummed yet (``.metadata``, markers), write ``MANIFEST``."""
    rest = [n for n in os.listdir(directory) if n not in entries and n != MANIFEST and not n.startswith(MANIFEST)]
    files = {**entries, **checksum_files(directory, [n for n in rest if os.path.isfile(os.path.join(directory, n))])}
    text = json.dumps({"format": _MANIFEST_FORMAT, "files": dict(sorted(files.items()))})
    target = os.path.join(directory, MANIFEST)
    try:
        atomic_write_text(target, text)
    except OSError as exc:
        exc.filename = exc.filename or target
        raise


def verify(directory: str, *, full: bool, what: str) -> None:
    """Check ``directory`` against its ``MANIFEST``: sizes, and CRC-32 too when ``full``. Every rank must call it.

    A directory without a manifest passes if it was written before checksums existed (its marker does not
    promise one), or when not ``full``.

    Raises:
        ValueError: on every rank, naming the first missing, truncated or corrupt file.
    """
    error, path = None, os.path.join(directory, MANIFEST)
    fix = "restore the file from a copy, or load an earlier checkpoint"
    try:
        files: dict[str, Any] = {}
        if os.path.exists(path):
            try:
                with open(path) as f:
                    data = json.load(f)
                files = data["files"]
                if data.get("format") != _MANIFEST_FORMAT or not isinstance(files, dict):
                    raise ValueError(f"not a {_MANIFEST_FORMAT} manifest")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}: unreadable checksum manifest ({exc}); the checkpoint is damaged") from None
        if full and not os.path.exists(path) and has_checksums(directory):  # deleting it must not turn them off
            raise ValueError(
                f"{path}: missing, but this checkpoint was written with one; restore it from a copy, or load with "
                "verify=False to skip the checks"
            )
        for name in sorted(files)[env.rank() :: env.world_size()]:
            (size, crc), file = files[name], os.path.join(directory, name)
            if not os.path.isfile(file):
                error = f"{file}: missing, but it was written at save ({MANIFEST} lists it); {fix}"
            elif (actual := os.path.getsize(file)) != size:
                error = f"{file}: {actual} bytes, but {size} were written at save (truncated or overwritten); {fix}"
            elif full and (got := file_crc32(file)) != crc:
                error = f"{file}: CRC-32 {got:08x} differs from {crc:08x} recorded at save (the file is corrupt); {fix}"
            if error:
                break
    except (OSError, ValueError, TypeError) as exc:
        error = str(exc)
    raise_on_any_rank(error, what=what, error_type=ValueError)


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
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual is None or actual < size:
            found = "missing" if actual is None else f"{actual} bytes"
            return f"{file}: {found}, but the checkpoint's .metadata needs {size} bytes (truncated?); restore the file"
    return None


_save_group: tuple[Any, Any] = (None, None)  # (the default group it belongs to, the group)
_stager: Any = None


def save_group() -> Any:
    """A gloo group of its own for DCP's background writes (sharing the training's group aborts gloo when both
    communicate at once). Created once per process group, at the first save that does not block: a collective."""
    global _save_group
    if not dist.is_initialized():
        return None
    world = dist.distributed_c10d._get_default_group()
    if _save_group[0] is not world:
        _save_group = (world, dist.new_group(backend="gloo"))
    return _save_group[1]


def stager() -> Any:
    """What copies the state for a background write before ``async_save`` returns, so that training may change
    it at once: to the CPU, through reused pinned memory on CUDA (as TorchTitan's ``async_with_pinned_mem``)."""
    global _stager
    if _stager is None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        _stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
    return _stager
