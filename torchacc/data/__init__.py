"""Split a user's DataLoader across data-parallel ranks and place its batches on the device.

The data path, by concept:

* sampling: :func:`shard_dataloader` (this module) rebuilds the loader around a resumable
  ``DistributedSampler`` (``torchacc/data/sampler.py``);
* iteration and resume position: :class:`ShardedDataLoader` (``torchacc/data/loader.py``);
* device placement: :func:`move_to_device` and the CUDA side-stream prefetch (``torchacc/data/placement.py``).
* context parallelism: each rank's chunk of every sequence, labels shifted first (``torchacc/data/context.py``),
  applied to every batch through ``shard_dataloader(transform=...)``.

All three public names are importable from here.

[Note: Equal step counts] Every rank must run the same number of steps, or the ranks that
finish early leave the others waiting in a collective forever. ``DistributedSampler`` gives each
rank exactly ``ceil(N / R)`` indices (padding by repeating samples) or ``floor(N / R)`` indices
(dropping the tail), so the per-rank batch count is identical whatever the loader's own
``drop_last`` is. We set the sampler's ``drop_last`` to the loader's: a loader that keeps its last
partial batch keeps every sample (at the cost of at most ``R - 1`` repeated ones), and a loader
that already discards incomplete batches also discards the uneven tail instead of repeating it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from .loader import ShardedDataLoader
from .placement import move_to_device
from .sampler import ResumableDistributedSampler

__all__ = ["ShardedDataLoader", "move_to_device", "shard_dataloader"]

_FIX = (
    "torchacc replaces the sampler with a DistributedSampler. Either build the DataLoader without a "
    "sampler/batch_sampler (use shuffle=True or False; shuffling can also be set with "
    "config.dataloader.shuffle), or pass shard=False (config.dataloader.shard=False) and split the data "
    "yourself using torchacc.dist.rank() and torchacc.dist.world_size()."
)


def _user_shuffle(loader: DataLoader) -> bool:
    """Return whether ``loader`` shuffles, raising if its sampling cannot be carried over."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"torchacc cannot split an iterable dataset ({type(loader.dataset).__name__}) across ranks. "
            "Split inside the dataset instead, by the rank (torchacc.dist.rank()/world_size()) and, with "
            "workers, torch.utils.data.get_worker_info(); then pass shard=False (config.dataloader.shard=False) "
            "so torchacc only places batches on the device."
        )
    # DataLoader(batch_sampler=...) sets batch_size to None, whatever the batch sampler's type (even
    # torch's BatchSampler); with batch_size= it builds its own BatchSampler and keeps batch_size.
    batch_sampler = loader.batch_sampler
    if loader.batch_size is None and batch_sampler is not None:
        raise ValueError(
            f"The DataLoader has a custom batch_sampler ({type(batch_sampler).__name__}), so its batch_size is None "
            "and torchacc, which replaces the sampler with a DistributedSampler, cannot rebuild its batches. Build "
            "the DataLoader with batch_size= and shuffle= instead of batch_sampler= (shuffling can also be set with "
            "config.dataloader.shuffle), or pass shard=False (config.dataloader.shard=False) and split the data "
            "yourself using torchacc.dist.rank() and torchacc.dist.world_size()."
        )
    sampler = loader.sampler
    if type(sampler) is SequentialSampler and len(sampler) == len(loader.dataset):
        return False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        return True
    raise ValueError(f"The DataLoader has a custom sampler ({type(sampler).__name__}). {_FIX}")


def shard_dataloader(
    loader: DataLoader,
    *,
    num_replicas: int,
    rank: int,
    device: torch.device,
    shuffle: bool | None = None,
    drop_last: bool | None = None,
    seed: int = 0,
    prefetch: bool = True,
    shard: bool = True,
    transform: Callable[[Any], Any] | None = None,
) -> ShardedDataLoader:
    """Rebuild ``loader`` so this rank sees only its share of the data, with batches on ``device``.

    The new DataLoader uses a ``DistributedSampler`` and keeps every other constructor argument of
    ``loader`` (batch_size, collate_fn, num_workers, pin_memory, timeout, worker_init_fn, generator,
    prefetch_factor, persistent_workers, multiprocessing_context, ...). All ranks get the same number
    of batches; see [Note: Equal step counts] at the top of this module for the drop_last rule.

    Args:
        loader: A DataLoader built with the default sampling (``shuffle=True`` or ``False``).
        num_replicas: Number of data-parallel ranks.
        rank: This process's data-parallel rank, in ``[0, num_replicas)``.
        device: Where batches are placed.
        shuffle: None keeps the loader's choice (RandomSampler shuffles, SequentialSampler does
            not); True or False overrides it.
        drop_last: None keeps the loader's ``drop_last``; True or False overrides it. Applies to
            both the sampler's uneven tail and the last partial batch.
        seed: Shuffle seed; must be the same on every rank.
        prefetch: On CUDA, copy the next batch on a side stream while the current one is used.
            No effect on other devices.
        shard: False skips the rebuild and only places batches on ``device`` (for data that is
            already split per rank). ``shuffle`` and ``drop_last`` are then ignored.
        transform: applied to every batch before it is placed, e.g. context parallelism's
            ``split_sequences`` (``torchacc/data/context.py``); also with ``shard=False``.

    Returns:
        A :class:`ShardedDataLoader` over this rank's batches.

    Raises:
        TypeError: If ``loader`` is not a ``torch.utils.data.DataLoader``.
        ValueError: If the loader has an iterable dataset, a custom sampler, or any ``batch_sampler=``
            (even torch's ``BatchSampler``), or ``num_replicas``/``rank`` are out of range.

    Example:
        >>> loader = DataLoader(dataset, batch_size=8, shuffle=True)
        >>> loader = shard_dataloader(loader, num_replicas=world_size, rank=rank, device=device)
        >>> for epoch in range(3):
        ...     for batch in loader:  # set_epoch is called for you
        ...         ...
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"shard_dataloader expects a torch.utils.data.DataLoader, got {type(loader).__module__}."
            f"{type(loader).__qualname__}. Wrap your dataset first: DataLoader(dataset, batch_size=...)."
        )
    if not shard:
        if shuffle is not None or drop_last is not None:
            warnings.warn("shard=False: shuffle and drop_last are ignored; the loader is used as given.", stacklevel=2)
        return ShardedDataLoader(loader, device=device, prefetch=prefetch, transform=transform)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}, got {rank}.")
    loader_shuffle = _user_shuffle(loader)
    shuffle = loader_shuffle if shuffle is None else shuffle
    drop_last = loader.drop_last if drop_last is None else drop_last
    # Without automatic batching (batch_size=None) every sample is its own batch and DataLoader
    # rejects drop_last=True, so only the sampler drops the tail.
    loader_drop_last = drop_last and loader.batch_size is not None
    sampler = ResumableDistributedSampler(
        loader.dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    rebuilt = DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader_drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )
    return ShardedDataLoader(rebuilt, device=device, prefetch=prefetch, transform=transform)
