"""Where each tensor storage of a memory-mapped ``torch.load`` result lies in its file.

``torch.load(path, mmap=True)`` maps the whole file, so a storage's address minus its record's file
offset is the same for every storage. Matching sorted addresses to sorted record offsets, and
checking that the difference is constant and the sizes agree, pairs them without relying on torch
internals. Where that check fails the caller falls back to reading the tensors through the mapping.
"""

import re
from typing import Any

from ..._utils.tree import iter_tensors
from .zip import record_table

__all__ = ["is_tensor_record", "locate_storages"]


def is_tensor_record(name: str) -> bool:
    """Whether a zip member of a ``torch.save`` file holds tensor data (``<archive>/data/<key>``)."""
    return re.fullmatch(r"[^/]+/data/\w+", name) is not None


def locate_storages(path: str, loaded: Any) -> dict[int, tuple[int, int, int, str]] | None:
    """Map the address of every non-empty storage in ``loaded`` (``torch.load(path, mmap=True)``) to the
    (file offset, size, CRC-32, name) of its record, or None when the two cannot be paired with certainty."""
    storages: dict[int, int] = {}
    for tensor in iter_tensors(loaded):
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    table = record_table(path)
    records = sorted((o, size, crc, name) for o, (name, size, crc) in table.items() if is_tensor_record(name) and size)
    addresses = sorted(storages)
    if len(records) != len(addresses) or not records:
        return None
    base = addresses[0] - records[0][0]
    pairs = dict(zip(addresses, records, strict=True))
    if any(a - base != o or storages[a] != size for a, (o, size, _, _) in pairs.items()):
        return None
    return pairs
