"""A DistributedSampler that can start an epoch part-way through, for resumable data loading.

[Note: Resuming mid-epoch] ``DistributedSampler`` draws one global order per epoch that does not
depend on the number of replicas ``R`` (a permutation seeded with ``seed + epoch``, or
``range(N)``), pads it by repeating its head (or cuts its tail, with ``drop_last``) to a multiple
of ``R``, and gives rank ``r`` the entries ``r, r + R, r + 2R, ...``. After every rank has taken
``k`` samples, the union of what was taken is exactly the first ``k * R`` entries of that order.

We generalise this to a *split* of the epoch that starts at entry ``split_start`` of the global
order: the entries ``order[split_start:]`` are padded by repeating their own head (or cut, with
``drop_last``) to a multiple of ``R`` and dealt out the same way. A fresh epoch is the split that
starts at 0, which is exactly ``DistributedSampler``'s. A position in an epoch is then
``(split_start, R, k)``: ``k`` samples taken per rank from the split ``(split_start, R)``.

* Same ``R``: the next pass continues the same split and skips the ``k`` samples each rank took,
  so every rank gets bitwise the indices of the uninterrupted run.
* Different ``R``: the next pass starts a new split at ``split_start + k * R_old``, so the new
  ranks share the samples not yet taken, each exactly once (plus the usual padding, repeated from
  the remaining samples, or minus the usual tail, with ``drop_last``), and no sample already taken
  in this epoch comes back.

Padding only ever sits in the last per-rank batch of a split, so a position that is not at the end
of the split never includes padding and a re-split is always exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

__all__ = [
    "MATCHED_FIELDS",
    "STATE_VERSION",
    "ResumableDistributedSampler",
    "check_state",
    "batch_count",
    "split_samples",
]

STATE_VERSION = 1
# Fields that must match between the saved and the current loader; num_replicas may differ.
MATCHED_FIELDS = ("dataset_len", "batch_size", "seed", "shuffle", "drop_last")
_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "version": (int,),
    "sharded": (bool,),
    "epoch": (int,),
    "batches_consumed": (int,),
}
_SHARDED_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "split_start": (int,),
    "num_replicas": (int,),
    "batch_size": (int, type(None)),
    "seed": (int,),
    "shuffle": (bool,),
    "drop_last": (bool,),
    "dataset_len": (int,),
}


def split_samples(remaining: int, num_replicas: int, drop_last: bool) -> int:
    """Return the per-rank sample count when ``remaining`` samples are split over ``num_replicas`` ranks.

    Args:
        remaining: Number of entries of the epoch's global order that the split deals out.
        num_replicas: Number of ranks.
        drop_last: Cut the uneven tail instead of padding it.

    Returns:
        The number of samples each rank gets; for ``remaining = len(dataset)`` this equals
        ``DistributedSampler.num_samples``.
    """
    if drop_last:
        return remaining // num_replicas
    return math.ceil(remaining / num_replicas)


def batch_count(samples: int, batch_size: int | None, drop_last: bool) -> int:
    """Return how many batches a DataLoader makes of ``samples`` indices.

    Args:
        samples: Number of indices the sampler yields.
        batch_size: The DataLoader's batch size; None means every sample is its own batch.
        drop_last: The DataLoader's ``drop_last``.

    Returns:
        The number of batches.
    """
    if batch_size is None:
        return samples
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def check_state(state: Any, sharded: bool) -> None:
    """Raise if ``state`` is not a well-formed dataloader state of the given kind.

    Args:
        state: The dict passed to ``ShardedDataLoader.load_state_dict``.
        sharded: Whether the loading loader is sharded (has a ``ResumableDistributedSampler``).

    Raises:
        TypeError: If ``state`` is not a mapping.
        ValueError: If its version, kind, keys, value types or signs are wrong. Checks that need the
            loader (matching fields, the position being inside its epoch) are left to the caller.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict returned by ShardedDataLoader.state_dict(), got {type(state).__name__}.")
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"Unsupported dataloader state version {state.get('version')!r} (this torchacc reads version "
            f"{STATE_VERSION}); pass a dict returned by ShardedDataLoader.state_dict()."
        )
    if state.get("sharded") is not sharded:
        kind = {True: "a sharded loader (shard=True)", False: "an unsharded loader (shard=False)"}
        raise ValueError(
            f"The state was saved from {kind.get(state.get('sharded'), 'an unknown loader')} but this is "
            f"{kind[sharded]}; build the loader with the same shard setting as the run that saved it."
        )
    types = {**_STATE_TYPES, **(_SHARDED_STATE_TYPES if sharded else {})}
    missing = sorted(set(types) - set(state))
    if missing:
        raise ValueError(f"The dataloader state is missing {missing}; pass a dict returned by state_dict().")
    for name, allowed in types.items():
        value = state[name]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            expected = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"The dataloader state field {name!r} must be {expected}, got {value!r}.")
    for name in ("epoch", "batches_consumed", "split_start"):
        if state.get(name, 0) < 0:
            raise ValueError(f"The dataloader state field {name!r} must be >= 0, got {state[name]}.")
    if sharded and state["num_replicas"] < 1:
        raise ValueError(f"The dataloader state field 'num_replicas' must be >= 1, got {state['num_replicas']}.")


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` whose next pass can start part-way through the epoch.

    With the default position (``split_start == 0`` and ``skip == 0``) it yields exactly what
    ``DistributedSampler`` yields. See [Note: Resuming mid-epoch] at the top of this module.

    Attributes:
        split_start: Entries of the epoch's global order taken before the current split began.
        skip: Leading samples of this rank's share of the split that the next pass leaves out.
        requested_epoch: The epoch of the latest :meth:`set_epoch` call that the loader has not taken
            yet, or None; see [Note: The set_epoch idiom] in ``torchacc.data._epoch``.
    """

    def __init__(
        self, dataset: Dataset, *, num_replicas: int, rank: int, shuffle: bool, seed: int, drop_last: bool
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.split_start = 0
        self.skip = 0
        self.requested_epoch: int | None = None

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass, as ``DistributedSampler.set_epoch`` does.

        A ``ShardedDataLoader`` over this sampler takes the call as its own ``set_epoch(epoch)``, so
        the usual ``loader.sampler.set_epoch(epoch)`` before each pass picks the epoch.

        Args:
            epoch: The epoch; the shuffle is seeded with ``seed + epoch``.
        """
        super().set_epoch(epoch)
        self.requested_epoch = epoch

    def use_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass without recording a user call; for the loader's own calls.

        Args:
            epoch: The epoch; the shuffle is seeded with ``seed + epoch``.
        """
        super().set_epoch(epoch)

    def split_size(self, split_start: int, num_replicas: int | None = None) -> int:
        """Return the per-rank sample count of the split that starts at ``split_start``.

        Args:
            split_start: Entries of the global order taken before the split.
            num_replicas: Ranks sharing the split; defaults to this sampler's.

        Returns:
            The number of samples each rank gets from the split, before any ``skip``.
        """
        replicas = self.num_replicas if num_replicas is None else num_replicas
        return split_samples(len(self.dataset) - split_start, replicas, self.drop_last)

    def start_at(self, split_start: int = 0, skip: int = 0) -> None:
        """Make every following pass start at ``skip`` samples into the split at ``split_start``.

        Args:
            split_start: Entries of the global order taken before the split, in
                ``[0, len(dataset)]``.
            skip: Samples of this rank's share to leave out, in ``[0, split_size(split_start)]``.

        Raises:
            ValueError: If either value is out of range.
        """
        size = len(self.dataset)
        if not 0 <= split_start <= size:
            raise ValueError(f"split_start must be in [0, {size}] for a dataset of {size} samples, got {split_start}.")
        share = self.split_size(split_start)
        if not 0 <= skip <= share:
            raise ValueError(f"skip must be in [0, {share}] for split_start={split_start}, got {skip}.")
        self.split_start = split_start
        self.skip = skip

    def resume(self, *, split_start: int, num_replicas: int, taken: int) -> None:
        """Start the next pass after every rank took ``taken`` samples of the split ``(split_start, num_replicas)``.

        Args:
            split_start: Where the saved split began in the epoch's global order.
            num_replicas: The number of ranks that shared the saved split.
            taken: Samples each of those ranks took; less than their share of the split.

        Raises:
            ValueError: If ``taken`` is not less than the saved split's per-rank share.
        """
        share = self.split_size(split_start, num_replicas)
        if taken < 0 or (taken and taken >= share):
            raise ValueError(
                f"taken must be 0 or less than the per-rank share ({share}) of the split at {split_start} over "
                f"{num_replicas} ranks, got {taken}."
            )
        if num_replicas == self.num_replicas:
            self.start_at(split_start, taken)
        else:
            self.start_at(split_start + taken * num_replicas, 0)

    def _global_order(self) -> list[int]:
        # The same order DistributedSampler draws, so a re-split agrees with what earlier ranks took.
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=generator).tolist()
        return list(range(len(self.dataset)))

    def __iter__(self) -> Iterator[int]:
        if self.split_start == 0:
            indices = list(super().__iter__())
        else:
            remaining = self._global_order()[self.split_start :]
            total = self.split_size(self.split_start) * self.num_replicas
            if len(remaining) < total:
                remaining = (remaining * math.ceil(total / len(remaining)))[:total]
            indices = remaining[self.rank : total : self.num_replicas]
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return self.split_size(self.split_start) - self.skip
