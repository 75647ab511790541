"""Split every sequence of a batch over the ranks of one context-parallel group: ``split_sequences``.

[Note: context-parallel batches] The ranks of one CP group take the same samples (the sampler runs over the
data-parallel ranks only) and each keeps one chunk of every sequence: dim 1 of the sequence tensors
(``SEQUENCE_KEYS``). Three things must be right for the chunks to train exactly like the whole sequence:

* Targets. The labels are shifted before the split, as transformers' causal-LM loss would shift them
  (``shift_labels[:, t] = labels[:, t + 1]``, the last position ignored), so the target of a chunk's last
  token, which is the next chunk's first token, is not lost. The model's loss reads ``shift_labels`` and
  does not shift the chunk again; ``labels`` stays in the batch (transformers computes a loss only when it
  is given) and is split like the rest.
* Positions. ``position_ids`` are positions in the whole sequence (``0..S-1`` unless the batch brings its
  own), so rotary embeddings know where each chunk lies.
* Length. A length that is not a multiple of the number of chunks is padded at the end (input id 0,
  attention mask 0, targets ignored, positions continuing). Pad tokens come after every real token, so
  causal attention never lets a real token see them, and they have no targets: the loss and the gradients
  are those of the unpadded batch.
"""

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "SEQUENCE_KEYS", "split_sequences"]

IGNORE_INDEX = -100
"""The target that the loss skips (transformers' and ``torch.nn.CrossEntropyLoss``'s default)."""
SEQUENCE_KEYS = (
    "input_ids",
    "inputs_embeds",
    "attention_mask",
    "position_ids",
    "token_type_ids",
    "labels",
    "shift_labels",
)
"""Batch keys whose dim 1 is the sequence; every other value is passed on whole."""

_PAD_VALUES = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX}  # others: 0


def split_sequences(batch: Any, *, rank: int, size: int, head_tail: bool = False) -> dict[str, Any]:
    """Keep chunk ``rank`` of ``size`` of every sequence in ``batch``; see [Note: context-parallel batches].

    Args:
        batch: a mapping with ``input_ids`` (or ``inputs_embeds``) of shape ``(batch, seq, ...)`` and optionally
            ``labels``, ``shift_labels``, ``attention_mask`` (2-D, 1 for tokens to attend to), ``position_ids``
            and ``token_type_ids``.
        rank: this rank's index in its CP group.
        size: the number of ranks in the group.
        head_tail: cut ``2 * size`` chunks and keep chunks ``rank`` and ``2 * size - 1 - rank`` (the layout of
            torch's load-balanced ring attention) instead of one contiguous chunk.

    Returns:
        A new dict: the sequence tensors cut to this rank's chunk, ``position_ids`` and (when ``labels`` is
        given) ``shift_labels`` added, other values unchanged.

    Raises:
        ValueError: ``batch`` is not a mapping, has neither ``input_ids`` nor ``inputs_embeds``, or holds a
            sequence tensor whose length differs from the others' or an ``attention_mask`` that is not 2-D.

    Example:
        >>> batch = {"input_ids": torch.arange(8).view(1, 8), "labels": torch.arange(8).view(1, 8)}
        >>> split_sequences(batch, rank=1, size=2)["shift_labels"]
        tensor([[5, 6, 7, -100]])
    """
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"dist.cp splits every sequence of a batch, so batches must be dicts (e.g. {{'input_ids': ..., "
            f"'labels': ...}}), got {type(batch).__name__}; return a dict from the dataset or the collate_fn"
        )
    key = "input_ids" if "input_ids" in batch else "inputs_embeds"
    if batch.get(key) is None:
        raise ValueError(
            f"dist.cp splits the sequences of a batch along dim 1, but the batch has neither input_ids nor "
            f"inputs_embeds (keys: {', '.join(map(str, batch))}); name the token ids 'input_ids'"
        )
    out = dict(batch)
    num_batch, length = out[key].shape[:2]
    if out.get("labels") is not None and out.get("shift_labels") is None:
        out["shift_labels"] = F.pad(out["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(length, device=out[key].device).expand(num_batch, length)
    mask = out.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"dist.cp needs a 2-D attention_mask (batch, seq) of ones and zeros, got shape {tuple(mask.shape)}; "
            "leave the causal mask to the model"
        )
    num_chunks = 2 * size if head_tail else size
    padded = -(-length // num_chunks) * num_chunks
    for name in SEQUENCE_KEYS:
        value = out.get(name)
        if value is None:
            continue
        if value.dim() < 2 or value.shape[1] != length:
            raise ValueError(
                f"dist.cp: batch[{name!r}] has shape {tuple(value.shape)}, but the sequences of batch[{key!r}] are "
                f"{length} long; every sequence tensor must be (batch, {length}, ...)"
            )
        out[name] = _chunk(_pad(name, value, padded), rank=rank, size=size, head_tail=head_tail)
    return out


def _pad(name: str, value: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - value.shape[1]
    if extra == 0:
        return value
    if name == "position_ids":
        step = torch.arange(1, extra + 1, device=value.device, dtype=value.dtype)
        return torch.cat([value, value[:, -1:] + step], dim=1)
    tail = value.new_full((value.shape[0], extra, *value.shape[2:]), _PAD_VALUES.get(name, 0))
    return torch.cat([value, tail], dim=1)


def _chunk(value: torch.Tensor, *, rank: int, size: int, head_tail: bool) -> torch.Tensor:
    if not head_tail:
        return value.chunk(size, dim=1)[rank].contiguous()
    pieces = value.chunk(2 * size, dim=1)
    return torch.cat([pieces[rank], pieces[2 * size - 1 - rank]], dim=1)
