"""Write a ``torch.save``-compatible file one tensor at a time.

``torch.save`` needs every tensor in memory at once. Consolidating or resharding a checkpoint
larger than RAM needs the opposite: know the layout (names, shapes, dtypes) up front, then produce
and write each tensor and drop it, or copy its bytes straight from the shard files. This writer does
that in torch's zip container (see ``_zip``): the pickled skeleton first, then the tensor records in
any order. ``torch.load`` (with or without ``mmap=True`` and ``weights_only=True``) reads the result
like any other checkpoint; the round-trip tests guard the format.
"""

import collections
import io
import math
import os
import pickle
import sys
from typing import Any

import torch

from ..._utils.tree import iter_tensors
from .file_ranges import FileRange
from .zip import ZipWriter

__all__ = ["TensorSlot", "StreamingTorchWriter"]

_PICKLE_PROTOCOL = 2  # what torch.save uses


class TensorSlot:
    """A placeholder for a contiguous CPU tensor that is written later."""

    def __init__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.key, self.shape, self.dtype = key, tuple(shape), dtype
        self.numel = math.prod(self.shape)

    def __reduce_ex__(self, protocol: int) -> tuple:
        stride = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        args = (_StorageRef(self), 0, torch.Size(self.shape), stride, False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


class _StorageRef:
    def __init__(self, slot: TensorSlot) -> None:
        self.slot = slot


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.slot.dtype])
            return ("storage", storage_type, obj.slot.key, "cpu", obj.slot.numel)
        return None


class StreamingTorchWriter:
    """Write ``skeleton`` (any picklable structure holding ``TensorSlot``s) to ``path``, tensor by tensor.

    Args:
        path: the output file (written in place; callers rename a temp file for atomicity).
        skeleton: the object ``torch.load`` will return, with a ``TensorSlot`` for every tensor.
        write_back: start writing copied bytes to disk at once, for a caller that fsyncs the file.
        check_sources: compare every whole source record that ``copy`` reads with its CRC-32.

    Example:
        >>> slot = TensorSlot("0", (2, 3), torch.float32)
        >>> with StreamingTorchWriter("out.pt", {"w": slot}) as w:
        ...     w.write(slot, torch.zeros(2, 3))
    """

    def __init__(
        self, path: str | os.PathLike[str], skeleton: Any, *, write_back: bool = True, check_sources: bool = False
    ) -> None:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer, protocol=_PICKLE_PROTOCOL)
        pickler.dump(skeleton)
        self._slots: dict[str, TensorSlot] = {slot.key: slot for slot in iter_tensors(skeleton, kind=TensorSlot)}
        self._written: set[str] = set()
        self._writer = ZipWriter(path, write_back=write_back, check_sources=check_sources)
        self._writer.add_bytes("data.pkl", buffer.getvalue())

    def _claim(self, slot: TensorSlot) -> None:
        if slot.key in self._written:
            raise AssertionError(f"slot {slot.key} written twice")
        self._written.add(slot.key)

    def write(self, slot: TensorSlot, tensor: torch.Tensor) -> None:
        """Write the data of ``slot``; ``tensor`` must match its shape and dtype."""
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise AssertionError(f"{tuple(tensor.shape)} {tensor.dtype} does not fit slot {slot.shape} {slot.dtype}")
        self._claim(slot)
        data = tensor.detach().cpu().contiguous()
        self._writer.add_bytes(f"data/{slot.key}", data.reshape(-1).view(torch.uint8).numpy())

    def copy(self, slot: TensorSlot, ranges: list[FileRange]) -> None:
        """Write the data of ``slot`` by copying ``ranges`` of other files (its bytes, in order)."""
        size = sum(r.length for r in ranges)
        if size != slot.numel * slot.dtype.itemsize:
            raise AssertionError(f"{size} bytes do not fit slot {slot.shape} {slot.dtype}")
        self._claim(slot)
        self._writer.add_ranges(f"data/{slot.key}", ranges)

    def close(self) -> None:
        """Write the trailer records and the directory; every slot must have been written."""
        missing = sorted(set(self._slots) - self._written)
        if missing:
            raise AssertionError(f"{len(missing)} tensor slot(s) never written, first: {missing[0]}")
        self._writer.add_bytes(".format_version", b"1")
        self._writer.add_bytes(".storage_alignment", str(torch.serialization._get_storage_alignment()).encode())
        self._writer.add_bytes("byteorder", sys.byteorder.encode())
        self._writer.add_bytes("version", b"3\n")
        self._writer.close()

    def abort(self) -> None:
        """Close the file unfinished (the caller removes it); a no-op after ``close``."""
        self._writer.abort()

    def __enter__(self) -> "StreamingTorchWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
