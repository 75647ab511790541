"""What keeps a fake step on the code paths of the real one (see [Note: fake step] in trace.py).

A fake tensor has a size and no values. Code that reads values either fails (``values_refused`` turns that into
the ``ValueError`` it is) or, in transformers, takes the branch it takes while tracing a graph, which the real
step does not take (``unpacked_batches`` answers the one such check the default batch meets).
"""

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor

__all__ = ["unpacked_batches", "values_refused"]


@contextlib.contextmanager
def values_refused(model: nn.Module) -> Iterator[None]:
    """A step that reads a tensor's value (``.item()``, a branch on its contents) as the ``ValueError`` it is."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise ValueError(
            f"{type(model).__name__}'s forward reads tensor values ({exc}), which the estimate cannot follow: its "
            "step runs on fake tensors, which have no values; make the forward independent of them (no .item(), "
            "no branch on a tensor's contents), or measure a real step inside torchacc.track_memory()"
        ) from None


_patch_lock = threading.Lock()
_patch: dict[str, Any] = {"depth": 0, "real": None}  # nested or concurrent fake steps share one patch


@contextlib.contextmanager
def unpacked_batches(default_batch: bool) -> Iterator[None]:
    """Under the default batch, transformers' packed-sequence check answers as in the real step: not packed.

    Without a KV cache (activation checkpointing turns it off) transformers looks for packed sequences in the
    position ids; reading their values is what it cannot do on a fake tensor, so it keeps a packed-sequence mask
    and materializes a [seq, seq] attention mask per layer that the real step never builds (SDPA runs with
    ``is_causal``): the estimate of a checkpointed step then grew with the square of the sequence length. Real
    position ids are still read.
    """
    masking = sys.modules.get("transformers.masking_utils")
    if not default_batch or masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    with _patch_lock:
        if _patch["depth"] == 0:
            real = _patch["real"] = masking.find_packed_sequence_indices
            masking.find_packed_sequence_indices = lambda ids: None if isinstance(ids, FakeTensor) else real(ids)
        _patch["depth"] += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch["depth"] -= 1
            if _patch["depth"] == 0:
                masking.find_packed_sequence_indices = _patch["real"]
