"""A cheap digest of a tensor's bytes, so that ranks can find out which tensors differ without sending them.

[Note: the tensor digest] The digest is a Fletcher-style pair over the tensor's bytes in row-major order, read
as 8-byte words (native byte order, the last word zero-padded): the sum of the words and the sum of
(position + 1) x word, both modulo 2**64 (int64 arithmetic that wraps). It is exact on bits: -0.0 and 0.0, or
two NaN payloads, are different words. Any change to a single word changes the sum, and moving values to other
positions changes the weighted sum. It is a checksum, not a cryptographic hash: differences built to cancel
can collide.

The weighted sum needs no position vector as long as the data. A chunk of whole rows is viewed as a matrix
of ``_ROW_WORDS`` columns, so the word in row r and column c has position ``r * _ROW_WORDS + c + 1`` in it:
its weighted sum is ``_ROW_WORDS * sum_r r * row_sum[r] + sum_c (c + 1) * column_sum[c]``, from two native
int64 reductions of the chunk (the second reads it from the cache) and no int64 copy of the data. Row and
column sums of whole chunks simply add up; a chunk's offset in the tensor comes from Fletcher's running sum
of the chunks' totals.
"""

import functools
from collections.abc import Iterator

import torch

__all__ = ["tensor_digest"]

# Bytes digested at a time (a multiple of 8 * _ROW_WORDS), also the largest buffer allocated for a non-contiguous
# tensor. 1 MiB (128 rows of 1024 words) stays in a core's L2 cache for the second reduction; 256 KiB was slower
# (more Python calls per byte) and 2-4 MiB no faster on a 2-core EPYC VM (benchmarks/README.md, set-up time).
_CHUNK_BYTES = 1 << 20
_ROW_WORDS = 1024


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """The digest of ``tensor``'s bytes (see [Note: the tensor digest]); equal tensors give equal digests.

    The digest depends only on the dtype's bytes in row-major order, not on strides or storage offset, and
    is computed in chunks of at most ``_CHUNK_BYTES``; a non-contiguous tensor is copied one chunk at a time.

    Args:
        tensor: any dtype, shape and layout, on any device (strided, not meta).

    Returns:
        An int64 tensor of shape ``[2]`` on ``tensor``'s device: the sum and the position-weighted sum of the words.
    """
    tensor = tensor.detach()
    digest = _Fletcher(tensor.device)
    # int64 views need the byte offset into the storage, and the address, to be multiples of 8.
    aligned = tensor.storage_offset() * tensor.element_size() % 8 == 0 and tensor.data_ptr() % 8 == 0
    if tensor.is_contiguous() and aligned:
        data = tensor.reshape(-1).view(torch.uint8)
        for start in range(0, data.numel(), _CHUNK_BYTES):
            digest.update(data[start : start + _CHUNK_BYTES])
        return digest.result()
    # A gathered piece rarely ends on a word boundary: the bytes go through one staging buffer, so every
    # chunk but the last holds whole words and the positions are those of the contiguous tensor.
    staging = torch.empty(_CHUNK_BYTES, dtype=torch.uint8, device=tensor.device)
    filled = 0
    for piece in _contiguous_pieces(tensor, max(1, _CHUNK_BYTES // tensor.element_size())):
        data = piece.reshape(-1).view(torch.uint8)
        while data.numel():
            count = min(_CHUNK_BYTES - filled, data.numel())
            staging[filled : filled + count].copy_(data[:count])
            filled, data = filled + count, data[count:]
            if filled == _CHUNK_BYTES:
                digest.update(staging)
                filled = 0
    if filled:
        digest.update(staging[:filled])
    return digest.result()


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


class _Fletcher:
    """The running pair of [Note: the tensor digest], fed a tensor's bytes in chunks, in order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: list[torch.Tensor] = []  # pairs of the last, partial chunk, at their positions in the tensor
        self.num_words = 0
        self.num_chunks = 0  # whole chunks so far, added into the four accumulators below
        self.rows = self.columns = self.total = self.running = torch.empty(0)

    def update(self, data: torch.Tensor) -> None:
        """Add ``data``: contiguous uint8 at an 8-byte aligned offset; only the last chunk may be shorter."""
        if data.numel() == _CHUNK_BYTES:
            self._add_chunk(data.view(torch.int64).view(-1, _ROW_WORDS))
            return
        num_full = data.numel() // 8
        words = data[: num_full * 8].view(torch.int64)
        num_rows = words.numel() // _ROW_WORDS
        if num_rows:
            matrix = words[: num_rows * _ROW_WORDS].view(num_rows, _ROW_WORDS)
            row_sums = matrix.sum(dim=1)
            self._add(row_sums.sum(), _weighted(row_sums, matrix.sum(dim=0)), matrix.numel())
        tail = words[num_rows * _ROW_WORDS :]
        if tail.numel():
            self._add(tail.sum(), _weighted(tail[:0], tail), tail.numel())
        if data.numel() % 8:
            padded = torch.zeros(8, dtype=torch.uint8, device=data.device)
            padded[: data.numel() % 8] = data[num_full * 8 :]
            word = padded.view(torch.int64)[0]
            self._add(word, word, 1)

    def _add_chunk(self, matrix: torch.Tensor) -> None:
        if not self.num_chunks:
            self.rows, self.columns = matrix.new_zeros(matrix.shape[0]), matrix.new_zeros(_ROW_WORDS)
            self.total, self.running = matrix.new_zeros(()), matrix.new_zeros(())
        row_sums = matrix.sum(dim=1)  # first: the row reduction streams from memory faster than the column one
        self.rows.add_(row_sums)
        self.columns.add_(matrix.sum(dim=0))
        self.total.add_(row_sums.sum())
        self.running.add_(self.total)  # after J chunks: the sum over j of (J - j) * (chunk j's total)
        self.num_chunks += 1
        self.num_words += matrix.numel()

    def _add(self, total: torch.Tensor, weighted: torch.Tensor, num_words: int) -> None:
        """Add the pair of the next ``num_words`` words, ``weighted`` with positions counted from 1 among them."""
        if self.num_words:
            weighted = weighted + total * self.num_words
        self.parts.append(torch.stack([total, weighted]))
        self.num_words += num_words

    def result(self) -> torch.Tensor:
        if self.num_chunks:
            # Chunk j starts after j * chunk_words words: its weighted sum gains j * chunk_words * (its total).
            offsets = (self.total * self.num_chunks - self.running) * (_CHUNK_BYTES // 8)
            self.parts.insert(0, torch.stack([self.total, offsets + _weighted(self.rows, self.columns)]))
        if not self.parts:
            return torch.zeros(2, dtype=torch.int64, device=self.device)
        return self.parts[0] if len(self.parts) == 1 else torch.stack(self.parts).sum(dim=0)


def _weighted(row_sums: torch.Tensor, column_sums: torch.Tensor) -> torch.Tensor:
    """The sum of (r * _ROW_WORDS + c + 1) * word[r, c] over a matrix of words, from its row and column sums
    (a single row shorter than _ROW_WORDS: no row sums, and the words themselves as column sums)."""
    row_weights, column_weights = _weights(_CHUNK_BYTES // 8 // _ROW_WORDS, _ROW_WORDS, row_sums.device)
    by_row = (row_sums * row_weights[: row_sums.numel()]).sum() * _ROW_WORDS
    return by_row + (column_sums * column_weights[: column_sums.numel()]).sum()


@functools.lru_cache(maxsize=8)
def _weights(max_rows: int, num_columns: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices ``0..max_rows-1`` and column positions ``1..num_columns``, as int64 on ``device``."""
    rows = torch.arange(max_rows, dtype=torch.int64, device=device)
    return rows, torch.arange(1, num_columns + 1, dtype=torch.int64, device=device)
