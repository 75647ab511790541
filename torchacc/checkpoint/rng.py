"""This rank's random states (Python, NumPy when imported, torch's CPU and accelerator generators), saved and
restored by ``save_checkpoint`` / ``load_checkpoint``, so that dropout after a resume draws what it would have
drawn without the restart.
"""

import random
import sys
from typing import Any

import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """This rank's random states, as values that load back without running code (tensors, tuples, numbers)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": (version, torch.tensor(internal), gauss), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, key, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(key.copy()), pos, has_gauss, cached)
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None:
        module = getattr(torch, accelerator.type)
        state[accelerator.type] = module.get_rng_state(torch.accelerator.current_device_index())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned (states of generators this process lacks are skipped)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal.tolist()), gauss))
    torch.set_rng_state(state["torch"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        kind, key, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, key.numpy(), pos, has_gauss, cached))
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None and accelerator.type in state:
        module = getattr(torch, accelerator.type)
        module.set_rng_state(state[accelerator.type], torch.accelerator.current_device_index())
