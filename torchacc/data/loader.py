"""``ShardedDataLoader``: iterate one rank's batches on its device, and save or restore the position.

``shard_dataloader`` (``torchacc/data/__init__.py``) builds it; batches reach the device through
``place_batches`` (``torchacc/data/placement.py``). ``ShardedDataLoader.state_dict``/``load_state_dict``
save and restore the position in the data; see [Note: Resuming mid-epoch] in
``torchacc.data.sampler`` for how a position carries over to a different number of ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from ._epoch import apply_epoch, record_user_epochs, take_user_epoch
from .observe import BatchObserver, observed
from .placement import place_batches
from .sampler import MATCHED_FIELDS, STATE_VERSION, ResumableDistributedSampler, batch_count, check_state

__all__ = ["ShardedDataLoader"]


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

    Each new pass sets the sampler's epoch (when the sampler has ``set_epoch``) so shuffling differs
    between epochs and agrees between ranks. ``epoch`` starts at 0 and increments after every pass;
    ``set_epoch`` overrides the value used by the next pass. The ``DistributedSampler`` idiom works
    too: ``loader.sampler.set_epoch(epoch)`` before a pass is the same as ``loader.set_epoch(epoch)``
    (also for a user's own sampler with ``shard=False``), so setting the saved epoch after
    :meth:`load_state_dict` continues it. Built by :func:`shard_dataloader`.

    The position in the data can be saved with :meth:`state_dict` and restored with
    :meth:`load_state_dict`, also with a different number of ranks.

    Attributes:
        loader: The torch DataLoader that is iterated (rebuilt, or the user's one if not sharded).
        device: Where batches are placed.
        transform: Applied to every batch before it is placed (context parallelism's sequence split), or None.

    Example:
        >>> state = loader.state_dict()  # after some steps; store it with the model checkpoint
        >>> # ... in the restarted run, after shard_dataloader()/accelerate():
        >>> loader.load_state_dict(state)
        >>> for epoch in range(state["epoch"], num_epochs):
        ...     loader.sampler.set_epoch(epoch)  # optional; the saved epoch continues where it stopped
        ...     for batch in loader:
        ...         ...
    """

    def __init__(
        self,
        loader: DataLoader,
        *,
        device: torch.device,
        prefetch: bool = True,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.transform = transform
        self._epoch = 0
        self._progress: _Progress | None = None  # the latest pass
        self._resume: _Progress | None = None  # a loaded position the next pass starts at
        self._skip_reads = 0  # batches an unsharded resumed pass reads and discards
        self._observer: BatchObserver | None = None
        record_user_epochs(loader.sampler)

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
        self._take_user_epoch()
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (the shuffle seed offset) used by the next pass.

        After :meth:`load_state_dict`, setting the loaded epoch keeps the resume position, and any
        other epoch discards it so the next pass is a full one. ``loader.sampler.set_epoch(epoch)`` has
        the same effect.
        """
        self._take_user_epoch()  # a call on the sampler made before this one
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
        self._take_user_epoch()
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
        mid-epoch] in ``torchacc.data.sampler``. An unsharded loader (``shard=False``) cannot
        skip indices, so its next pass reads and discards the consumed batches.

        Args:
            state: A dict returned by :meth:`state_dict`.

        Raises:
            TypeError: If ``state`` is not a mapping.
            ValueError: If ``state`` is malformed, was saved with a different shard setting, its
                ``batch_size``, ``seed``, ``shuffle``, ``drop_last`` or ``dataset_len`` differs from
                this loader's, or its position is past the end of its epoch.
        """
        self._take_user_epoch()  # a call on the sampler made before the load does not override it
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

    def observe(self, observer: BatchObserver | None) -> None:
        """Report the batches of every later pass to ``observer`` (None stops it); see ``BatchObserver``."""
        self._observer = observer

    def _take_user_epoch(self) -> None:
        # See [Note: The set_epoch idiom] in torchacc.data._epoch.
        epoch = take_user_epoch(self.loader.sampler)
        if epoch is not None:
            self.set_epoch(epoch)

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
        """A full epoch's batches at this number of ranks, also after a resume: see :attr:`num_batches_remaining`."""
        self._take_user_epoch()
        sampler = self.loader.sampler
        if isinstance(sampler, ResumableDistributedSampler):
            return batch_count(sampler.split_size(0), self.loader.batch_size, self.loader.drop_last)
        return len(self.loader)

    @property
    def num_batches_remaining(self) -> int:
        """The batches the pass in progress has still to yield, or, between passes, that the next pass yields:
        ``len(self)`` but for a pass that resumes mid-epoch after :meth:`load_state_dict`."""
        self._take_user_epoch()
        progress = self._progress
        if self._resume is None and progress is not None and not progress.done and progress.left is not None:
            return progress.left
        return len(self.loader) - self._skip_reads

    def __iter__(self) -> Iterator[Any]:
        # The epoch is set here, not lazily on the first next(): the DataLoader iterator draws the
        # sampler's indices when it is created, so the epoch must be set before iter(self.loader).
        self._take_user_epoch()
        apply_epoch(self.loader.sampler, self._epoch)
        start = self._resume
        self._resume = None
        if start is None:
            self._clear_resume()
            start = _Progress(self._epoch)
        progress = _Progress(start.epoch, start.split_start, start.batches, left=self._len_or_none(self._skip_reads))
        self._progress = progress
        self._epoch += 1
        # Resumed mid-epoch, the iterator's seed was drawn from the global generator before the random state that
        # load_checkpoint restores; drawing it again would shift every later draw (dropout masks).
        with torch.random.fork_rng(devices=[], enabled=bool(start.batches or start.split_start)):
            batches = iter(self.loader)
        if self._skip_reads:
            batches = itertools.islice(batches, self._skip_reads, None)
        if self._observer is not None:
            observing = observed(batches, self._observer, self.device, prefetch=self.prefetch, transform=self.transform)
            return self._count(observing, progress)
        if self.transform is not None:
            batches = map(self.transform, batches)
        return self._count(place_batches(batches, self.device, prefetch=self.prefetch), progress)

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
