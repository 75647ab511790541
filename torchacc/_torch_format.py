"""Write a ``torch.save``-compatible file one tensor at a time.

``torch.save`` needs every tensor in memory at once. Consolidating or resharding a checkpoint
larger than RAM needs the opposite: know the layout (names, shapes, dtypes) up front, then produce
and write each tensor and drop it. This writer does that with torch's own zip container
(``torch._C.PyTorchFileWriter``): tensor records first, in any order, the pickled skeleton last.
``torch.load`` (with or without ``mmap=True`` and ``weights_only=True``) reads the result like any
other checkpoint; the round-trip tests guard the format.
"""

import collections
import io
import math
import os
import pickle
import sys
from typing import Any

import torch

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

    Example:
        >>> slot = TensorSlot("0", (2, 3), torch.float32)
        >>> with StreamingTorchWriter("out.pt", {"w": slot}) as w:
        ...     w.write(slot, torch.zeros(2, 3))
    """

    def __init__(self, path: str | os.PathLike[str], skeleton: Any) -> None:
        buffer = io.BytesIO()
        self._slots: dict[str, TensorSlot] = {}
        pickler = _Pickler(buffer, protocol=_PICKLE_PROTOCOL)
        pickler.dump(skeleton)
        self._collect(skeleton)
        self._pickled = buffer.getvalue()
        self._written: set[str] = set()
        self._writer = torch._C.PyTorchFileWriter(os.fspath(path))

    def _collect(self, obj: Any) -> None:
        if isinstance(obj, TensorSlot):
            self._slots[obj.key] = obj
        elif isinstance(obj, dict):
            for value in obj.values():
                self._collect(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                self._collect(value)

    def write(self, slot: TensorSlot, tensor: torch.Tensor) -> None:
        """Write the data of ``slot``; ``tensor`` must match its shape and dtype."""
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise AssertionError(f"{tuple(tensor.shape)} {tensor.dtype} does not fit slot {slot.shape} {slot.dtype}")
        if slot.key in self._written:
            raise AssertionError(f"slot {slot.key} written twice")
        data = tensor.detach().cpu().contiguous()
        num_bytes = data.numel() * data.element_size()
        if data.storage_offset() != 0 or data.untyped_storage().nbytes() != num_bytes:
            data = data.clone()  # a view into a larger storage: write only its own bytes
        self._writer.write_record(f"data/{slot.key}", data.untyped_storage(), num_bytes)
        self._written.add(slot.key)

    def close(self) -> None:
        """Write the skeleton and the trailer; every slot must have been written."""
        missing = sorted(set(self._slots) - self._written)
        if missing:
            raise AssertionError(f"{len(missing)} tensor slot(s) never written, first: {missing[0]}")
        self._writer.write_record("data.pkl", self._pickled, len(self._pickled))
        self._writer.write_record(".format_version", "1", 1)
        alignment = str(torch.serialization._get_storage_alignment())
        self._writer.write_record(".storage_alignment", alignment, len(alignment))
        self._writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._writer.write_end_of_file()

    def __enter__(self) -> "StreamingTorchWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
