"""``model.forward(...)`` on an accelerated model runs through ``model(...)``.

FSDP2 all-gathers the parameters, and DDP prepares the gradient sync, in forward hooks that only
``model(...)`` (``Module.__call__``) runs. Calling ``model.forward(...)`` directly, a common habit, would
skip them and fail deep inside with "got mixed torch.Tensor and DTensor". The instance's ``forward`` is
wrapped so that a direct call goes through ``model(...)`` instead; inside ``model(...)`` it is the
original forward.
"""

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch.nn as nn

__all__ = ["route_forward_through_call"]


class _ThroughCall:
    def __init__(self, model: nn.Module, forward: Callable[..., Any]) -> None:
        self.model = weakref.ref(model)
        self.forward = forward
        self.depth = 0  # > 0 while model(...) runs
        functools.update_wrapper(self, forward, updated=())  # not __dict__: it would bring a wrapped wrapper's forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model()
        if self.depth == 0 and model is not None:
            return model(*args, **kwargs)
        return self.forward(*args, **kwargs)


def route_forward_through_call(model: nn.Module) -> nn.Module:
    """Make a direct ``model.forward(...)`` behave as ``model(...)``, so the sharding hooks run."""
    through = _ThroughCall(model, model.forward)

    def enter(*_: Any) -> None:
        through.depth += 1

    def leave(*_: Any) -> None:
        through.depth -= 1

    model.register_forward_pre_hook(enter, prepend=True)
    model.register_forward_hook(leave, always_call=True)
    model.forward = through
    return model
