"""Watching a loader's batches: what ``torchacc.metrics`` hooks into to count tokens and time the data wait.

``ShardedDataLoader.observe(observer)`` sends every later pass through :func:`observed`. Nothing changes for
a loader without an observer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from .placement import place_batches

__all__ = ["BatchObserver", "observed"]


class BatchObserver(Protocol):
    """Sees each batch twice: on the host as the DataLoader yields it, and as the caller receives it."""

    def read(self, batch: Any) -> Any:
        """Called with each host batch as the DataLoader yields it (before the loader's transform and the copy to
        the device); returns a note (no tensor), handed back to ``delivered`` with that batch."""

    def delivered(self, note: Any, wait_seconds: float) -> None:
        """Called as the caller receives the batch, with the seconds it waited for it."""


def observed(
    batches: Iterable[Any],
    observer: BatchObserver,
    device: torch.device,
    *,
    prefetch: bool,
    transform: Callable[[Any], Any] | None = None,
) -> Iterator[Any]:
    """``place_batches(map(transform, batches), device, prefetch=prefetch)``, reporting each batch to ``observer``.

    The observer reads each batch before ``transform``: under context parallelism it sees the whole sequences,
    not this rank's chunks of them. Each batch travels with its note through the placement (which moves tensors
    only), so a batch copied ahead by the prefetch cannot be credited to the one before it.
    """
    read = observer.read
    notes = ((batch, read(batch)) for batch in batches)
    if transform is not None:
        notes = ((transform(batch), note) for batch, note in notes)
    pairs = place_batches(notes, device, prefetch=prefetch)
    clock = time.perf_counter
    while True:
        start = clock()
        pair = next(pairs, None)
        if pair is None:
            return
        batch, note = pair
        observer.delivered(note, clock() - start)
        yield batch
