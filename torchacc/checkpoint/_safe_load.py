"""Loading that runs no code from the file unless the caller opts in with ``weights_only=False``.

[Note: safe loading] A pickle can call any function while it is read, so a checkpoint from an
untrusted place could run code. torchacc reads every file it loads without that power by default:

* ``torch.save`` files with ``torch.load(weights_only=True)`` (tensors, containers, numbers, strings);
* the small non-tensor entries of its DCP checkpoints (optimizer groups, scheduler, data position,
  ``extra``), which it encodes as ``torch.save`` bytes (:func:`encode`) and decodes the same way;
* DCP's own ``.metadata`` (a pickle) with an unpickler that admits only DCP's metadata classes, and
  DCP's non-tensor entries (which DCP itself reads with ``weights_only=False``) with ``weights_only=True``.

``weights_only=False`` restores plain pickle loading for files the caller trusts (objects of their own
classes, numpy arrays, checkpoints of torchacc before this format).
"""

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["OPT_IN", "SafeLoadPlanner", "SafeEmptyLoadPlanner", "SafeReader", "UnsafeFileError", "decode", "encode"]
__all__ += ["refusal"]

OPT_IN = "weights_only=False"
_ZIP_MAGIC = b"PK\x03\x04"


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


def decode(blob: bytes, *, weights_only: bool, what: str) -> Any:
    """Read back what :func:`encode` wrote, running no code unless ``weights_only`` is False.

    Raises:
        ValueError: the bytes hold objects that only a full unpickler builds (see :func:`refusal`).
    """
    if not isinstance(blob, bytes):
        raise ValueError(f"{what}: expected encoded bytes, found {type(blob).__name__}; the checkpoint is damaged")
    if not blob.startswith(_ZIP_MAGIC):  # a pickle, as torchacc-dcp/1 checkpoints stored it
        if weights_only:
            raise refusal(what, "a bare pickle written by an older torchacc")
        return pickle.loads(blob)
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        raise refusal(what, _first_line(exc)) from None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if "Unsupported global" in line or "GLOBAL" in line]
    return lines[0] if lines else str(exc).splitlines()[0]


def _metadata_classes() -> dict[tuple[str, str], Any]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    classes: list[Any] = [
        metadata.Metadata,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        torch.Size,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
    ]
    allowed = {(c.__module__, c.__qualname__): c for c in classes}
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: any other global is refused."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if type(self)._allowed is None:
            type(self)._allowed = _metadata_classes()
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        found = type(self)._allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")
        return found


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
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeBytes:
    """Read DCP's non-tensor entries with ``torch.load(weights_only=...)`` instead of DCP's ``weights_only=False``."""

    weights_only: bool = True
    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=self.weights_only)
        except pickle.UnpicklingError as exc:
            raise refusal(f"checkpoint entry {fqn!r}", _first_line(exc)) from None
        # as DefaultLoadPlanner.load_bytes, after its torch.load(weights_only=False)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` with safe non-tensor entries."""

    def __init__(self, *, weights_only: bool = True) -> None:
        super().__init__()
        self.weights_only = weights_only


class SafeEmptyLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds a state dict from the metadata (``keys`` or all), with safe non-tensor entries."""

    def __init__(self, keys: set[str] | None = None, *, weights_only: bool = True) -> None:
        super().__init__(keys=keys)
        self.weights_only = weights_only
