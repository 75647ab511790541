"""Optimizer steps that are not training steps.

torch's ``set_optimizer_state_dict`` creates an empty optimizer's state by taking one step with zero gradients
and a learning rate of 0 (``_init_optim_state``). That step runs every optimizer step hook, so torchacc's
metrics would count it as the run's first step (and record it). The checkpoint code marks such calls with
``internal_optimizer_steps()``; the metrics hooks ignore the steps taken inside it.
"""

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["internal_optimizer_steps", "in_internal_optimizer_step"]

_state = threading.local()


@contextlib.contextmanager
def internal_optimizer_steps() -> Iterator[None]:
    """Mark the optimizer steps taken in this block (on this thread) as not training steps."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def in_internal_optimizer_step() -> bool:
    """Whether this thread is inside ``internal_optimizer_steps()``."""
    return getattr(_state, "depth", 0) > 0
