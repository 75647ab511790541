"""What keeps a fake step on the code paths of the real one (see [Note: fake step] in trace.py).

A fake tensor has a size and no values. Code that reads values either fails (``values_refused`` turns that into
the ``ValueError`` it is) or, in transformers, takes the branch it takes while tracing a graph, which the real
step does not take (``unpacked_batches`` answers the one such check the default batch meets).
"""

import contextlib
import sys
from collections.abc import Iterator

import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

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


@contextlib.contextmanager
def unpacked_batches(default_batch: bool) -> Iterator[None]:
    """Under the default batch, transformers' packed-sequence check answers as in the real step: not packed.

    Without a KV cache (activation checkpointing turns it off) transformers looks for packed sequences in the
    position ids; reading their values is what it cannot do on a fake tensor, so it keeps a packed-sequence mask
    and materializes a [seq, seq] attention mask per layer that the real step never builds (SDPA runs with
    ``is_causal``): the estimate of a checkpointed step then grew with the square of the sequence length.
    """
    masking = sys.modules.get("transformers.masking_utils")
    if not default_batch or masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    real = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None  # the default batch's are 0..seq-1
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = real
