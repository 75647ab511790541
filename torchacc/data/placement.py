"""Place batches on the device: move nested containers of tensors, optionally copying ahead on CUDA.

``ShardedDataLoader`` (``torchacc/data_loader.py``) sends every pass through :func:`place_batches`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["move_to_device", "place_batches"]

_END = object()


def move_to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Recursively move every tensor in ``batch`` to ``device``; other values pass through.

    Dicts and other mappings (including HF ``BatchEncoding``), lists, tuples and namedtuples are
    rebuilt with their original type where that type can be rebuilt, else as a plain dict/list/tuple.

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
    if isinstance(batch, torch.Tensor):
        async_ok = non_blocking and device.type == "cuda" and batch.device.type == "cpu" and batch.is_pinned()
        return batch.to(device, non_blocking=async_ok)
    if isinstance(batch, Mapping):
        moved = {k: move_to_device(v, device, non_blocking=non_blocking) for k, v in batch.items()}
        if isinstance(batch, MutableMapping):
            # A shallow copy keeps constructor state that type(batch)(moved) would lose
            # (defaultdict's factory, BatchEncoding's encodings).
            try:
                clone = copy.copy(batch)
                clone.update(moved)
                return clone
            except (TypeError, AttributeError):
                pass
        try:
            return type(batch)(moved)
        except TypeError:
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(v, device, non_blocking=non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        moved_seq = [move_to_device(v, device, non_blocking=non_blocking) for v in batch]
        try:
            return type(batch)(moved_seq)
        except TypeError:
            return tuple(moved_seq) if isinstance(batch, tuple) else moved_seq
    return batch


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


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


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
        for tensor in _tensors(batch):
            if tensor.device.type == "cuda":
                tensor.record_stream(current_stream)
        upcoming = load()
        yield batch
