"""Tell the epochs a user sets on a loader's sampler from the ones ``ShardedDataLoader`` sets itself.

[Note: The set_epoch idiom] A ``DistributedSampler`` training loop calls
``loader.sampler.set_epoch(epoch)`` before each pass. ``ShardedDataLoader`` also sets the sampler's
epoch at the start of every pass, from its own counter, which would silently override the user's
call. So every user call is recorded, and the loader takes the recorded epoch as if
``loader.set_epoch(epoch)`` had been called the next time it looks (at the start of a pass, in
``state_dict``, ``len()``, ...), while the loader's own per-pass calls go through :func:`apply_epoch`,
which records nothing. The call itself is recorded, not a change of value, so setting the same epoch
again (to repeat an epoch) counts too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .sampler import ResumableDistributedSampler

__all__ = ["apply_epoch", "record_user_epochs", "take_user_epoch"]


class _RecordedSetEpoch:
    """Stands in for a foreign sampler's bound ``set_epoch``: forwards each call and records its epoch."""

    def __init__(self, set_epoch: Callable[[int], None]) -> None:
        self.forward = set_epoch
        self.requested: int | None = None

    def __call__(self, epoch: int) -> None:
        self.forward(epoch)  # first, so a call the sampler rejects is not recorded
        self.requested = epoch


def record_user_epochs(sampler: Any) -> None:
    """Record from now on the calls to ``sampler.set_epoch``, for :func:`take_user_epoch`.

    ``ResumableDistributedSampler`` records them itself; a sampler without ``set_epoch`` has nothing
    to record.

    Args:
        sampler: The sampler of the DataLoader that a ``ShardedDataLoader`` iterates.
    """
    set_epoch = getattr(sampler, "set_epoch", None)
    if isinstance(sampler, ResumableDistributedSampler) or not callable(set_epoch):
        return
    if isinstance(set_epoch, _RecordedSetEpoch):  # another loader over the same sampler records already
        return
    # A user's sampler (shard=False) is not ours to subclass, and its epoch attribute, if it has one,
    # cannot tell a repeated call from no call. An instance attribute that shadows the class's method
    # sees every call made through the object, whatever the sampler class, and changes nothing else;
    # the loader's own calls go to the original method (apply_epoch), so only the user's are recorded.
    try:
        sampler.set_epoch = _RecordedSetEpoch(set_epoch)
    except AttributeError:  # a sampler with __slots__ and no __dict__
        warnings.warn(
            f"Calls to {type(sampler).__name__}.set_epoch cannot be recorded, so each pass uses the loader's "
            "epoch counter; call set_epoch(epoch) on the loader returned by torchacc instead of on its sampler.",
            stacklevel=3,
        )


def take_user_epoch(sampler: Any) -> int | None:
    """Return the epoch of the latest user call to ``sampler.set_epoch`` not taken yet, and forget it.

    Args:
        sampler: A sampler passed to :func:`record_user_epochs`, or a ``ResumableDistributedSampler``.

    Returns:
        The epoch, or None if there was no such call.
    """
    if isinstance(sampler, ResumableDistributedSampler):
        epoch, sampler.requested_epoch = sampler.requested_epoch, None
        return epoch
    recorder = getattr(sampler, "set_epoch", None)
    if not isinstance(recorder, _RecordedSetEpoch):
        return None
    epoch, recorder.requested = recorder.requested, None
    return epoch


def apply_epoch(sampler: Any, epoch: int) -> None:
    """Set the sampler's epoch for the loader's next pass, without recording it as a user call.

    Args:
        sampler: The sampler of the DataLoader that a ``ShardedDataLoader`` iterates.
        epoch: The epoch of the pass; a sampler without ``set_epoch`` is left alone.
    """
    if isinstance(sampler, ResumableDistributedSampler):
        sampler.use_epoch(epoch)
        return
    set_epoch = getattr(sampler, "set_epoch", None)
    if isinstance(set_epoch, _RecordedSetEpoch):
        set_epoch.forward(epoch)
    elif callable(set_epoch):
        set_epoch(epoch)
