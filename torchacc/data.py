"""Split a user's DataLoader across data-parallel ranks and place its batches on the device.

[Note: Equal step counts] Every rank must run the same number of steps, or the ranks that
finish early leave the others waiting in a collective forever. ``DistributedSampler`` gives each
rank exactly ``ceil(N / R)`` indices (padding by repeating samples) or ``floor(N / R)`` indices
(dropping the tail), so the per-rank batch count is identical whatever the loader's own
``drop_last`` is. We set the sampler's ``drop_last`` to the loader's: a loader that keeps its last
partial batch keeps every sample (at the cost of at most ``R - 1`` repeated ones), and a loader
that already discards incomplete batches also discards the uneven tail instead of repeating it.

``ShardedDataLoader.state_dict``/``load_state_dict`` save and restore the position in the data;
see [Note: Resuming mid-epoch] in ``torchacc._resumable_sampler`` for how a position carries over
to a different number of ranks.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ._resumable_sampler import MATCHED_FIELDS, STATE_VERSION, ResumableDistributedSampler, batch_count, check_state

__all__ = ["ShardedDataLoader", "move_to_device", "shard_dataloader"]

_END = object()


_FIX = (
    "torchacc replaces the sampler with a DistributedSampler. Either build the DataLoader without a "
    "sampler/batch_sampler (use shuffle=True or False; shuffling can also be set with "
    "config.dataloader.shuffle), or pass shard=False (config.dataloader.shard=False) and split the data "
    "yourself using torchacc.dist.rank() and torchacc.dist.world_size()."
)


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


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


@dataclass
class _Progress:
    """Where one pass over the data is; see ShardedDataLoader.state_dict for the fields."""

    epoch: int
    split_start: int = 0
    batches: int = 0  # batches of the split consumed, including those a resume skipped
    left: int | None = None  # batches the pass has still to yield; None for a loader without len()
    done: bool = False


class ShardedDataLoader:
    """Iterable over one rank's batches, already placed on ``device``.

    Each new pass calls ``sampler.set_epoch(epoch)`` (when the sampler has it) so shuffling differs
    between epochs and agrees between ranks. ``epoch`` starts at 0 and increments after every pass;
    ``set_epoch`` overrides the value used by the next pass. Built by :func:`shard_dataloader`.

    The position in the data can be saved with :meth:`state_dict` and restored with
    :meth:`load_state_dict`, also with a different number of ranks.

    Attributes:
        loader: The torch DataLoader that is iterated (rebuilt, or the user's one if not sharded).
        device: Where batches are placed.

    Example:
        >>> state = loader.state_dict()  # after some steps; store it with the model checkpoint
        >>> # ... in the restarted run, after shard_dataloader()/accelerate():
        >>> loader.load_state_dict(state)
        >>> for batch in loader:  # continues with the next batch of the saved epoch
        ...     ...
    """

    def __init__(self, loader: DataLoader, *, device: torch.device, prefetch: bool = True) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.prefetch = prefetch
        self._epoch = 0
        self._progress: _Progress | None = None  # the latest pass
        self._resume: _Progress | None = None  # a loaded position the next pass starts at
        self._skip_reads = 0  # batches an unsharded resumed pass reads and discards

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def epoch(self) -> int:
        """The epoch the next pass will use."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (the shuffle seed offset) used by the next pass.

        After :meth:`load_state_dict`, setting the loaded epoch keeps the resume position, and any
        other epoch discards it so the next pass is a full one.
        """
        if self._resume is not None and epoch != self._resume.epoch:
            self._clear_resume()
        self._epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Return the position in the data, as plain Python values (JSON-serializable).

        Only batches already yielded to the caller count as consumed, not ones prefetched. Once a
        pass has yielded its last batch the position is the start of the next epoch. The state is
        the same on every rank.

        Returns:
            A dict with ``version``, ``sharded``, ``epoch`` (the epoch in progress, or the next one),
            ``batches_consumed`` (batches of that epoch consumed per rank; after a resume with a
            different number of ranks, counted from that resume), and for a sharded loader also
            ``split_start`` (entries of the epoch's global sample order consumed before the current
            split over ranks began; 0 unless the epoch was resumed with a different number of ranks),
            ``num_replicas``, ``batch_size``, ``seed``, ``shuffle``, ``drop_last`` and ``dataset_len``.
        """
        progress = self._resume or self._progress
        if progress is None or progress.done or progress.left == 0:
            progress = _Progress(self._epoch)
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "sharded": isinstance(self.loader.sampler, ResumableDistributedSampler),
            "epoch": progress.epoch,
            "batches_consumed": progress.batches,
        }
        if state["sharded"]:
            sampler = self.loader.sampler
            state.update(
                split_start=progress.split_start,
                num_replicas=sampler.num_replicas,
                batch_size=self.loader.batch_size,
                seed=sampler.seed,
                shuffle=sampler.shuffle,
                drop_last=sampler.drop_last,
                dataset_len=len(self.loader.dataset),
            )
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass start at the position saved by :meth:`state_dict`.

        The next pass yields the rest of the saved epoch and the passes after it are full epochs
        ``epoch + 1, epoch + 2, ...``. For a sharded loader nothing is read to get there: the
        sampler skips the consumed indices. With the saved number of ranks every rank gets exactly
        the batches it would have got without the restart. With a different number of ranks, the
        samples of the epoch not consumed yet are split anew over the current ranks: each is seen
        once (plus the usual padding by repeating some of them, or minus the usual tail with
        ``drop_last``), and none already consumed in this epoch is seen again; see [Note: Resuming
        mid-epoch] in ``torchacc._resumable_sampler``. An unsharded loader (``shard=False``) cannot
        skip indices, so its next pass reads and discards the consumed batches.

        Args:
            state: A dict returned by :meth:`state_dict`.

        Raises:
            TypeError: If ``state`` is not a mapping.
            ValueError: If ``state`` is malformed, was saved with a different shard setting, its
                ``batch_size``, ``seed``, ``shuffle``, ``drop_last`` or ``dataset_len`` differs from
                this loader's, or its position is past the end of its epoch.
        """
        sampler = self.loader.sampler
        sharded = isinstance(sampler, ResumableDistributedSampler)
        check_state(state, sharded)
        epoch, batches = state["epoch"], state["batches_consumed"]
        if not sharded:
            num_batches = self._len_or_none()
            if batches and num_batches is not None and batches >= num_batches:
                raise ValueError(
                    f"The state says {batches} batches of epoch {epoch} were consumed, but the loader has only "
                    f"{num_batches} batches; pass the state of a loader over the same data."
                )
            self._resume = _Progress(epoch, batches=batches)
            self._skip_reads = batches
            self._epoch = epoch
            return
        current = self.state_dict()
        mismatched = [
            f"{name} (saved {state[name]!r}, current {current[name]!r})"
            for name in MATCHED_FIELDS
            if state[name] != current[name]
        ]
        if mismatched:
            raise ValueError(
                f"Cannot resume the dataloader: the saved state does not match this loader in {', '.join(mismatched)}. "
                "Build the DataLoader and call shard_dataloader/accelerate with the saved values, or, to start the "
                "data afresh, do not load the dataloader state."
            )
        split_start, replicas, size = state["split_start"], state["num_replicas"], len(self.loader.dataset)
        if split_start and split_start >= size:
            raise ValueError(
                f"The dataloader state field 'split_start' must be less than the dataset length {size}, got "
                f"{split_start}; pass a dict returned by state_dict()."
            )
        share = sampler.split_size(split_start, replicas)
        num_batches = batch_count(share, self.loader.batch_size, self.loader.drop_last)
        if batches and batches >= num_batches:
            raise ValueError(
                f"The state says {batches} batches of epoch {epoch} were consumed per rank, but that epoch has only "
                f"{num_batches} batches per rank over {replicas} ranks; pass a dict returned by state_dict() "
                f"(a finished epoch is saved as the start of the next), or call set_epoch({epoch + 1}) instead "
                "to start at the next epoch."
            )
        sampler.resume(split_start=split_start, num_replicas=replicas, taken=batches * (self.loader.batch_size or 1))
        if replicas == sampler.num_replicas:
            self._resume = _Progress(epoch, split_start=split_start, batches=batches)
        else:
            self._resume = _Progress(epoch, split_start=sampler.split_start)
        self._epoch = epoch

    def _clear_resume(self) -> None:
        self._resume = None
        self._skip_reads = 0
        if isinstance(self.loader.sampler, ResumableDistributedSampler):
            self.loader.sampler.start_at(0, 0)

    def _len_or_none(self, skip: int = 0) -> int | None:
        try:
            return len(self.loader) - skip
        except TypeError:  # a loader over an IterableDataset without __len__
            return None

    def __len__(self) -> int:
        return len(self.loader) - self._skip_reads

    def __iter__(self) -> Iterator[Any]:
        # set_epoch runs here, not lazily on the first next(): the DataLoader iterator draws the
        # sampler's indices when it is created, so the epoch must be set before iter(self.loader).
        if hasattr(self.loader.sampler, "set_epoch"):
            self.loader.sampler.set_epoch(self._epoch)
        start = self._resume
        self._resume = None
        if start is None:
            self._clear_resume()
            start = _Progress(self._epoch)
        progress = _Progress(start.epoch, start.split_start, start.batches, left=self._len_or_none(self._skip_reads))
        self._progress = progress
        self._epoch += 1
        batches = iter(self.loader)
        if self._skip_reads:
            batches = itertools.islice(batches, self._skip_reads, None)
        if self.prefetch and self.device.type == "cuda":
            return self._count(self._iter_prefetch(batches), progress)
        return self._count((move_to_device(batch, self.device, non_blocking=True) for batch in batches), progress)

    def _count(self, batches: Iterator[Any], progress: _Progress) -> Iterator[Any]:
        # Counted here, where the caller receives a batch, so prefetched batches are not consumed.
        for batch in batches:
            progress.batches += 1
            if progress.left is not None:
                progress.left -= 1
            yield batch
        progress.done = True
        if self._progress is progress and self._resume is None:
            self._clear_resume()  # len() is a full epoch again

    def _iter_prefetch(self, batches: Iterator[Any]) -> Iterator[Any]:
        # [Note: Side-stream prefetch] The next batch is copied on a side stream while the current
        # stream computes on this one. wait_stream orders the compute after the copy, and
        # record_stream stops the caching allocator from reusing the copy's memory, which the side
        # stream allocated, while the compute stream may still read it.
        stream = torch.cuda.Stream(device=self.device)

        def load() -> Any:
            batch = next(batches, _END)
            if batch is _END:
                return _END
            with torch.cuda.stream(stream):
                return move_to_device(batch, self.device, non_blocking=True)

        upcoming = load()
        while upcoming is not _END:
            current_stream = torch.cuda.current_stream(self.device)
            current_stream.wait_stream(stream)
            batch = upcoming
            for tensor in _tensors(batch):
                if tensor.device.type == "cuda":
                    tensor.record_stream(current_stream)
            upcoming = load()
            yield batch


def _user_shuffle(loader: DataLoader) -> bool:
    """Return whether ``loader`` shuffles, raising if its sampling cannot be carried over."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"torchacc cannot split an iterable dataset ({type(loader.dataset).__name__}) across ranks. "
            "Split inside the dataset instead, by the rank (torchacc.dist.rank()/world_size()) and, with "
            "workers, torch.utils.data.get_worker_info(); then pass shard=False (config.dataloader.shard=False) "
            "so torchacc only places batches on the device."
        )
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise ValueError(f"The DataLoader has a custom batch_sampler ({type(batch_sampler).__name__}). {_FIX}")
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

    Returns:
        A :class:`ShardedDataLoader` over this rank's batches.

    Raises:
        TypeError: If ``loader`` is not a ``torch.utils.data.DataLoader``.
        ValueError: If the loader has an iterable dataset or a custom sampler/batch_sampler, or
            ``num_replicas``/``rank`` are out of range.

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
        return ShardedDataLoader(loader, device=device, prefetch=prefetch)
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
    return ShardedDataLoader(rebuilt, device=device, prefetch=prefetch)
