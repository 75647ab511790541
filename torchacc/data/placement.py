"""Place batches on the device: move nested containers of tensors, optionally copying ahead on CUDA.

``ShardedDataLoader`` (``torchacc/data/loader.py``) sends every pass through :func:`place_batches`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .._utils.tree import iter_tensors, map_tensors

__all__ = ["move_to_device", "place_batches"]

_END = object()


def move_to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Recursively move every tensor in ``batch`` to ``device``; other values pass through.

    Dicts and other mappings (including HF ``BatchEncoding`` and ``defaultdict``), lists, tuples,
    namedtuples and dataclasses are rebuilt with their original type where that type can be rebuilt,
    else as a plain dict/list/tuple (see ``torchacc._utils.tree.map_tensors``).

    Args:
        batch: A tensor or a nested container of tensors.
        device: The target device.
        non_blocking: Request an asynchronous copy. It is used only for pinned CPU tensors going to
            a CUDA device, the one case where it is both asynchronous and safe.

    Returns:
        A structure of the same shape with its tensors on ``device``.

    Example:
        >>> batch = {"x": torch.zeros(2), "ids": [torch.ones(1), "meta"]}
        >>> moved = move_to_device(batch, torch.device("cpu"))
    """
    device = torch.device(device)

    def move(tensor: torch.Tensor) -> torch.Tensor:
        async_ok = non_blocking and device.type == "cuda" and tensor.device.type == "cpu" and tensor.is_pinned()
        return tensor.to(device, non_blocking=async_ok)

    return map_tensors(move, batch)


def place_batches(batches: Iterable[Any], device: torch.device, *, prefetch: bool) -> Iterator[Any]:
    """Lazily yield each of ``batches`` moved to ``device``.

    Args:
        batches: The batches as the DataLoader yields them.
        device: The target device.
        prefetch: On CUDA, copy the next batch on a side stream while the caller uses the current
            one; no effect on other devices.

    Returns:
        An iterator over the moved batches; nothing is read from ``batches`` before its first ``next()``.
    """
    device = torch.device(device)
    if prefetch and device.type == "cuda":
        return _prefetch(iter(batches), device)
    return (move_to_device(batch, device, non_blocking=True) for batch in batches)


def _prefetch(batches: Iterator[Any], device: torch.device) -> Iterator[Any]:
    # [Note: Side-stream prefetch] The next batch is copied on a side stream while the current
    # stream computes on this one. wait_stream orders the compute after the copy, and
    # record_stream stops the caching allocator from reusing the copy's memory, which the side
    # stream allocated, while the compute stream may still read it.
    stream = torch.cuda.Stream(device=device)

    def load() -> Any:
        batch = next(batches, _END)
        if batch is _END:
            return _END
        with torch.cuda.stream(stream):
            return move_to_device(batch, device, non_blocking=True)

    upcoming = load()
    while upcoming is not _END:
        current_stream = torch.cuda.current_stream(device)
        current_stream.wait_stream(stream)
        batch = upcoming
        for tensor in iter_tensors(batch):
            if tensor.device.type == "cuda":
                tensor.record_stream(current_stream)
        upcoming = load()
        yield batch
