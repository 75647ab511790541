"""A cheap digest of a tensor's bytes, so that ranks can find out which tensors differ without sending them.

[Note: the tensor digest] The tensor's bytes in row-major order are read as 8-byte words (native byte order),
``n`` whole ones and, when the size is not a multiple of 8, a last partial one, zero-padded. A small tensor
(``n < _MIN_ROWS * _ROW_WORDS``, about 510 KiB) is digested word by word; in a large one the first ``n // _ROW_WORDS``
rows of ``_ROW_WORDS`` consecutive words are each replaced by the sum of their words, and the leftover words
(fewer than a row, and the partial one) follow them. The digest is the Fletcher-style pair over that sequence
of values ``v``: ``sum(v)`` and ``sum((k + 1) * v[k])``, both modulo 2**64 (int64 arithmetic that wraps). The
first is the sum of all the words in either case.

What it detects, between two tensors of the same dtype and shape:

- any change to a single word (the sum changes): a changed element, -0.0 against 0.0, another NaN payload,
  weights drawn from another seed;
- values moved to other positions in a small tensor, or between rows (or into or out of the leftover words)
  of a large one: the weighted sum changes, unless the differences were built to cancel;
- not: values moved within one row of a large tensor (the row holds the same words in another order, so its
  sum is the same), e.g. two adjacent rows of a ``[*, 512]`` float32 matrix swapped when both lie inside one
  digest row. A row is ``_ROW_WORDS`` = 1021 words (about 8 KiB); the width is prime so that the digest's rows
  cut across a tensor's own rows (mostly powers of two long): swapped tensor rows or columns are caught unless
  they lie inside one digest row, and a random permutation of a large tensor (a per-rank ``randperm`` buffer)
  moves values between rows and is caught with overwhelming probability.

It is a checksum, not a cryptographic hash: differences built to cancel can collide. Replacing each row by its
sum is what makes it cheap: the row sums are one native int64 reduction that streams from memory at the speed of
``torch.sum`` (no second pass, no int64 copy of the data), and the weighted sum runs over a vector 1021 times
shorter than the data (benchmarks/README.md, set-up time). The same operations run on any device.
"""

import functools
from collections.abc import Iterator

import torch

__all__ = ["tensor_digest"]

_ROW_WORDS = 1021  # prime: see the Note
_MIN_ROWS = 64  # a tensor of fewer words than _MIN_ROWS * _ROW_WORDS (~510 KiB) is digested word by word
# Bytes staged at a time for a non-contiguous or misaligned tensor (whole rows: a multiple of 8 * _ROW_WORDS),
# also the largest buffer allocated for it.
_CHUNK_BYTES = 8 * _ROW_WORDS * 128

_weights_cache: dict[torch.device, torch.Tensor] = {}


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """The digest of ``tensor``'s bytes (see [Note: the tensor digest]); equal tensors give equal digests.

    The digest depends only on the dtype's bytes in row-major order, not on strides or storage offset. A
    contiguous tensor at an 8-byte aligned address is read in place, in one pass; any other is copied one chunk
    of at most ``_CHUNK_BYTES`` at a time.

    Args:
        tensor: any dtype, shape and layout, on any device (strided, not meta).

    Returns:
        An int64 tensor of shape ``[2]`` on ``tensor``'s device: the sum of the values and their weighted sum.

    Example:
        >>> tensor_digest(torch.zeros(3)).tolist()
        [0, 0]
    """
    tensor = tensor.detach()
    num_words = tensor.numel() * tensor.element_size() // 8  # whole words: a partial last one is never in a row
    num_rows = num_words // _ROW_WORDS if num_words >= _MIN_ROWS * _ROW_WORDS else 0
    # int64 views need the byte offset into the storage, and the address, to be multiples of 8.
    aligned = tensor.storage_offset() * tensor.element_size() % 8 == 0 and tensor.data_ptr() % 8 == 0
    if tensor.is_contiguous() and aligned:
        if tensor.numel() * tensor.element_size() % 8 == 0:  # the common case, in the fewest calls
            words = tensor.view(-1).view(torch.int64)
            return _fletcher(_values(words, num_rows=num_rows) if num_rows else words)
        return _fletcher(_values_of_bytes(tensor.reshape(-1).view(torch.uint8), num_rows=num_rows))
    # A gathered piece rarely ends on a word boundary: the bytes go through one staging buffer, so every
    # chunk but the last holds whole rows and the positions are those of the contiguous tensor.
    parts, offset, num_done = [], 0, 0  # values so far, and rows among them (every chunk but the last is rows)
    for chunk in _staged_chunks(tensor):
        rows_here = min(num_rows - num_done, chunk.numel() // (8 * _ROW_WORDS))
        values = _values_of_bytes(chunk, num_rows=rows_here)
        parts.append(_fletcher(values, offset=offset))
        offset, num_done = offset + values.numel(), num_done + rows_here
    if not parts:
        return torch.zeros(2, dtype=torch.int64, device=tensor.device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(dim=0)


def _values_of_bytes(data: torch.Tensor, *, num_rows: int) -> torch.Tensor:
    """The digest's values of ``data``, contiguous uint8 at an 8-byte aligned address (see :func:`_values`)."""
    num_whole = data.numel() // 8
    values = _values(data[: num_whole * 8].view(torch.int64), num_rows=num_rows)
    if data.numel() % 8 == 0:
        return values
    padded = torch.zeros(8, dtype=torch.uint8, device=data.device)
    padded[: data.numel() % 8] = data[num_whole * 8 :]
    return torch.cat([values, padded.view(torch.int64)])


def _values(words: torch.Tensor, *, num_rows: int) -> torch.Tensor:
    """The sums of the first ``num_rows`` rows of ``_ROW_WORDS`` int64 ``words``, then the other words."""
    if not num_rows:
        return words
    sums = words[: num_rows * _ROW_WORDS].view(num_rows, _ROW_WORDS).sum(dim=1)
    return sums if words.numel() == num_rows * _ROW_WORDS else torch.cat([sums, words[num_rows * _ROW_WORDS :]])


def _fletcher(values: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
    """``[sum(v), sum((offset + k + 1) * v[k])]`` of int64 ``values``, modulo 2**64."""
    device = values.device
    weights = _weights(values.numel(), device)
    if device.type == "cpu":
        pair = torch.mv(weights, values)  # one call: the per-tensor overhead matters for the small tensors
    else:  # no integer matrix-vector product on CUDA
        pair = torch.stack([values.sum(), (values * weights[1]).sum()])
    if offset:
        pair[1] += offset * pair[0]
    return pair


@functools.lru_cache(maxsize=256)  # a model has few distinct sizes; the slice is a view, kept with its base
def _weights(num_values: int, device: torch.device) -> torch.Tensor:
    """``[ones, 1..num_values]``: an int64 ``[2, num_values]`` view of a matrix cached per device. It grows by
    doubling, to at most twice the most values digested at once: under 65,344 for a small tensor (or a chunk of
    one), 1/1021 of the words (plus under 1021) for a large one."""
    weights = _weights_cache.get(device)
    if weights is None or weights.shape[1] < num_values:
        length = max(1024, 1 << (num_values - 1).bit_length())
        positions = torch.arange(1, length + 1, dtype=torch.int64, device=device)
        weights = _weights_cache[device] = torch.stack([torch.ones_like(positions), positions])
    return weights[:, :num_values]


def release_weights() -> None:
    """Free the cached weights (up to twice the most values digested at once, on each device): a sync runs once."""
    _weights.cache_clear()
    _weights_cache.clear()


def _staged_chunks(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """``tensor``'s bytes in row-major order, as contiguous uint8 chunks of ``_CHUNK_BYTES`` (the last shorter)."""
    staging = torch.empty(_CHUNK_BYTES, dtype=torch.uint8, device=tensor.device)
    filled = 0
    for piece in _contiguous_pieces(tensor, max(1, _CHUNK_BYTES // tensor.element_size())):
        data = piece.reshape(-1).view(torch.uint8)
        while data.numel():
            count = min(_CHUNK_BYTES - filled, data.numel())
            staging[filled : filled + count].copy_(data[:count])
            filled, data = filled + count, data[count:]
            if filled == _CHUNK_BYTES:
                yield staging
                filled = 0
    if filled:
        yield staging[:filled]


def _contiguous_pieces(tensor: torch.Tensor, max_numel: int) -> Iterator[torch.Tensor]:
    """Contiguous copies of ``tensor``'s consecutive row-major slices, each of at most ``max_numel`` elements
    (or one element, when an element is larger than that)."""
    if tensor.numel() <= max_numel or tensor.dim() == 0:
        yield tensor.contiguous()
        return
    row_numel = tensor[0].numel()
    if row_numel >= max_numel:
        for row in tensor:
            yield from _contiguous_pieces(row, max_numel)
        return
    step = max_numel // row_numel
    for start in range(0, tensor.shape[0], step):
        yield tensor[start : start + step].contiguous()
