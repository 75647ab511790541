"""Write safetensors files one tensor at a time (the layout is known before any data exists).

The format is an 8-byte little-endian header length, a JSON header mapping each name to its dtype,
shape and byte range, then the raw bytes in header order. Knowing every shape and dtype up front,
the header is written first and the tensors stream after it, so memory holds one tensor at a time.
"""

import json
import math
import os
import struct
from typing import Any, BinaryIO

import torch

from .file_ranges import FileRange, copy_ranges

__all__ = ["SAFETENSORS_DTYPES", "StreamingSafetensorsWriter"]

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class StreamingSafetensorsWriter:
    """Write the tensors described by ``layout`` to ``path``, in that order, one ``write`` call each.

    Args:
        path: the output file.
        layout: ``{name: (shape, dtype)}`` in the order the tensors will be written.
        metadata: the optional string-to-string ``__metadata__`` of the file.
        write_back: start writing copied bytes to disk at once, for a caller that fsyncs the file.
        check_sources: compare every whole source record that ``copy`` reads with its CRC-32.

    Raises:
        ValueError: a dtype safetensors cannot store.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
        metadata: dict[str, str] | None = None,
        *,
        write_back: bool = True,
        check_sources: bool = False,
    ) -> None:
        self._copy_options = {"write_back": write_back, "check_sources": check_sources}
        header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
        start = 0
        for name, (shape, dtype) in layout.items():
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"{name}: dtype {dtype} cannot be stored in safetensors; use --format torch")
            end = start + math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [start, end]}
            start = end
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
        self._order = list(layout)
        self._layout = layout
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)

    def _next(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if not self._order or self._order[0] != name:
            raise AssertionError(f"expected {self._order[:1]}, got {name!r}")
        self._order.pop(0)
        return self._layout[name]

    def copy(self, name: str, ranges: list[FileRange]) -> None:
        """Append ``name``'s data by copying ``ranges`` of other files (its bytes, in order)."""
        shape, dtype = self._next(name)
        size = sum(r.length for r in ranges)
        if size != math.prod(shape) * dtype.itemsize:
            raise AssertionError(f"{name}: {size} bytes != layout {tuple(shape)} {dtype}")
        self._file.flush()
        position = self._file.tell()
        copy_ranges(ranges, self._file.fileno(), position, **self._copy_options)
        self._file.seek(position + size)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``name``'s data; names must come in layout order."""
        shape, dtype = self._next(name)
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise AssertionError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} != layout {tuple(shape)} {dtype}")
        data = tensor.detach().cpu().contiguous()
        if data.numel():
            self._file.write(data.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no bytes copy

    def close(self) -> None:
        """Finish the file; every tensor must have been written."""
        if self._order:
            raise AssertionError(f"{len(self._order)} tensor(s) never written, first: {self._order[0]}")
        self._file.close()
