"""The per-tensor digest behind ``sync_tensors``: exact on bits, position-sensitive (in a large tensor: between rows
of 1021 words), the same for any layout."""

import pytest
import torch

from torchacc.distributed import _digest
from torchacc.distributed._digest import tensor_digest
from torchacc.distributed.sync import sync_tensors

MASK = (1 << 64) - 1


def reference_digest(tensor: torch.Tensor) -> list[int]:
    """The definition, in Python integers: the bytes as 8-byte words (the last one zero-padded); in a large tensor
    each row of ``_ROW_WORDS`` whole words replaced by its sum; the sum of the values and the sum of
    (position + 1) * value, both modulo 2**64 and read as signed int64."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    num_whole = data.numel() // 8  # a partial last word is never in a row
    data = torch.cat([data, data.new_zeros(-data.numel() % 8)])
    words = data.view(torch.int64).tolist()
    row = _digest._ROW_WORDS
    values = words
    if num_whole >= _digest._MIN_ROWS * row:
        num_rows = num_whole // row
        values = [sum(words[r * row : (r + 1) * row]) for r in range(num_rows)] + words[num_rows * row :]
    total = sum(values) & MASK
    weighted = sum((i + 1) * v for i, v in enumerate(values)) & MASK
    return [v - (1 << 64) if v >= 1 << 63 else v for v in (total, weighted)]


def digest(tensor: torch.Tensor) -> list[int]:
    return tensor_digest(tensor).tolist()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(37, generator=torch.Generator().manual_seed(0)),
        torch.randn(3, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        torch.randn(11, generator=torch.Generator().manual_seed(2)).to(torch.float16),
        torch.arange(-40, 41, dtype=torch.int64),
        torch.arange(13, dtype=torch.int32),
        torch.tensor([True, False, True, True, False]),
        torch.arange(9, dtype=torch.uint8),
        torch.tensor(3.5, dtype=torch.float64),
        torch.zeros(0),
    ],
    ids=["fp32", "bf16", "fp16", "int64", "int32", "bool", "uint8", "0-d", "empty"],
)
def test_digest_matches_its_definition_for_every_dtype(tensor):
    result = tensor_digest(tensor)
    assert result.dtype == torch.int64 and result.shape == (2,) and result.device == tensor.device
    assert result.tolist() == reference_digest(tensor)


def test_equal_tensors_give_equal_digests():
    a = torch.randn(100, 7)
    assert digest(a) == digest(a.clone())
    assert digest(a) != digest(torch.randn(100, 7))


def test_a_permutation_changes_the_digest():
    a = torch.arange(1, 65, dtype=torch.float32)
    swapped = a.clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert digest(swapped) != digest(a)
    assert digest(a.flip(0)) != digest(a)
    pairs = torch.tensor([1.0, 2.0, 3.0, 4.0])  # a swap inside one 8-byte word, and one across words
    assert len({tuple(digest(pairs[p])) for p in ([0, 1, 2, 3], [1, 0, 2, 3], [0, 2, 1, 3])}) == 3


def test_a_single_flipped_bit_changes_the_digest():
    a = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    for position, bit in [(0, 0), (517, 31), (999, 12), (256, 22)]:
        flipped = a.clone()
        flipped.view(torch.int32)[position] ^= 1 << bit
        assert digest(flipped) != digest(a), (position, bit)


def test_signed_zeros_and_nan_payloads_are_different_bits():
    assert digest(torch.tensor([0.0, 1.0])) != digest(torch.tensor([-0.0, 1.0]))
    quiet = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(quiet).all()
    assert digest(quiet[:1]) != digest(quiet[1:])
    assert digest(torch.tensor([float("nan")])) == digest(torch.tensor([float("nan")]))
    assert digest(torch.tensor([0.0], dtype=torch.bfloat16)) != digest(torch.tensor([-0.0], dtype=torch.bfloat16))


def test_non_contiguous_and_misaligned_tensors_digest_their_values():
    base = torch.randn(24, 10, generator=torch.Generator().manual_seed(4))
    for view in (base.t(), base[:, ::3], base[5:, 1:8], base.reshape(-1)[3:200], base.to(torch.bfloat16)[1:, 2:]):
        assert digest(view) == digest(view.contiguous()) == reference_digest(view)


def test_chunking_does_not_change_the_digest(monkeypatch):
    tensors = [
        torch.randn(5000, generator=torch.Generator().manual_seed(5)),
        torch.randn(70, 45, generator=torch.Generator().manual_seed(6)).t(),
        torch.randn(999, generator=torch.Generator().manual_seed(7)).to(torch.float16)[1:],
    ]
    small = [digest(t) for t in tensors]
    assert small == [reference_digest(t) for t in tensors]
    monkeypatch.setattr(_digest, "_ROW_WORDS", 5)  # large tensors: rows of 5 words, staged 4 rows at a time
    monkeypatch.setattr(_digest, "_MIN_ROWS", 3)
    monkeypatch.setattr(_digest, "_CHUNK_BYTES", 8 * 5 * 4)
    large = [digest(t) for t in tensors]
    assert large == [reference_digest(t) for t in tensors] == [digest(t.contiguous()) for t in tensors]
    assert all(a != b for a, b in zip(large, small, strict=True)), "the rows were not used"


def test_the_row_sums_start_at_the_documented_size():
    threshold = _digest._MIN_ROWS * _digest._ROW_WORDS
    below, at = torch.arange(threshold - 1), torch.arange(threshold + 7)
    assert digest(below) == reference_digest(below) and digest(at) == reference_digest(at)
    swapped = at.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # within the first row: the documented blind spot of a large tensor
    assert digest(swapped) == digest(at)
    swapped = below.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # a small tensor is digested word by word
    assert digest(swapped) != digest(below)


def test_tensors_larger_than_a_chunk_match_the_definition():
    big = torch.randn(300_001, generator=torch.Generator().manual_seed(8))  # rows, leftover words, padding
    odd = torch.randn(2_400_003, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)[1:]  # misaligned
    strided = torch.randn(1100, 1000, generator=torch.Generator().manual_seed(10)).t()  # staged, several chunks
    for tensor in (big, odd, strided):
        assert digest(tensor) == reference_digest(tensor)


def _large(seed: int) -> torch.Tensor:
    return torch.randn(4 * _digest._MIN_ROWS * _digest._ROW_WORDS, generator=torch.Generator().manual_seed(seed))


def test_what_ranks_differ_in_changes_the_digest_of_a_large_tensor():
    a = _large(11)
    assert digest(a) == digest(a.clone()) and digest(a) != digest(_large(12)), "another seed"
    for position in (0, 1, 2041, a.numel() // 2, a.numel() - 1):
        changed = a.clone()
        changed[position] = torch.nextafter(changed[position], torch.tensor(float("inf")))
        assert digest(changed) != digest(a), position
        signed = a.clone()
        signed[position] = 0.0
        negative = signed.clone()
        negative[position] = -0.0
        assert digest(signed) != digest(negative), position


def test_permutations_change_the_digest():
    for n in (1000, 3 * _digest._MIN_ROWS * _digest._ROW_WORDS + 5):  # small (word by word) and large (rows)
        perms = [torch.randperm(n, generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
        assert len({tuple(digest(p)) for p in perms}) == 4, n
        assert digest(perms[0].float()) != digest(perms[1].float()), n  # 2 elements a word
    square = torch.randn(512, 512, generator=torch.Generator().manual_seed(13))  # 256 words a row: the digest's
    # rows of 1021 words cut across the tensor's rows
    assert digest(square) != digest(square.t().contiguous())
    assert digest(square) != digest(square[[5, 1, 2, 3, 4, 0, *range(6, 512)]]), "two rows swapped"
    assert digest(square) == digest(square[[1, 0, *range(2, 512)]]), "the blind spot: both in one row of 1021 words"
    assert digest(square) != digest(square[:, [1, 0, *range(2, 512)]]), "two columns swapped"
    moved = square.clone().view(-1)
    far = 5 + 4 * _digest._ROW_WORDS  # a word two rows on (2 elements a word)
    moved[[5, far]] = moved[[far, 5]]
    assert digest(moved) != digest(square)


def test_memory_stays_bounded_for_a_non_contiguous_tensor(monkeypatch):
    wide = torch.randn(2, 300).t()  # one row of the transposed view is small, the whole tensor is 2400 bytes
    monkeypatch.setattr(_digest, "_CHUNK_BYTES", 256)
    monkeypatch.setattr(_digest, "_ROW_WORDS", 4)
    expected = reference_digest(wide)
    sizes = []
    real_contiguous = torch.Tensor.contiguous

    def spy(self, *args, **kwargs):
        sizes.append(self.numel() * self.element_size())
        return real_contiguous(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    assert digest(wide) == expected
    assert sizes and max(sizes) <= 256


def test_sync_in_a_world_of_one_sends_nothing():
    t = torch.ones(3)
    assert sync_tensors([t]) == 0 and sync_tensors([]) == 0
    assert t.tolist() == [1.0, 1.0, 1.0]
