"""The per-tensor digest behind ``sync_tensors``: exact on bits, position-sensitive, the same for any layout."""

import pytest
import torch

from torchacc.distributed import _digest
from torchacc.distributed._digest import tensor_digest
from torchacc.distributed.collectives import sync_tensors

MASK = (1 << 64) - 1


def reference_digest(tensor: torch.Tensor) -> list[int]:
    """The definition, in Python integers: the bytes as 8-byte words (the last one zero-padded); the sum of the
    words and the sum of (position + 1) * word, both modulo 2**64 and read as signed int64."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).tolist()
    data += [0] * (-len(data) % 8)
    words = [int.from_bytes(bytes(data[i : i + 8]), "little", signed=True) for i in range(0, len(data), 8)]
    total = sum(words) & MASK
    weighted = sum((i + 1) * w for i, w in enumerate(words)) & MASK
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
    full = [digest(t) for t in tensors]
    monkeypatch.setattr(_digest, "_CHUNK_BYTES", 64)  # many chunks, each spanning several 4-word rows
    monkeypatch.setattr(_digest, "_ROW_WORDS", 4)
    assert [digest(t) for t in tensors] == full == [reference_digest(t) for t in tensors]


def test_tensors_larger_than_a_chunk_match_the_definition():
    big = torch.randn(300_001, generator=torch.Generator().manual_seed(8))  # 1 MiB chunk, rows, tail, padding
    odd = torch.randn(600_003, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)[1:]  # misaligned
    assert digest(big) == reference_digest(big)
    assert digest(odd) == reference_digest(odd)


def test_memory_stays_bounded_for_a_non_contiguous_tensor(monkeypatch):
    wide = torch.randn(2, 300).t()  # one row of the transposed view is small, the whole tensor is 2400 bytes
    expected = reference_digest(wide)
    sizes = []
    real_contiguous = torch.Tensor.contiguous

    def spy(self, *args, **kwargs):
        sizes.append(self.numel() * self.element_size())
        return real_contiguous(self, *args, **kwargs)

    monkeypatch.setattr(_digest, "_CHUNK_BYTES", 256)
    monkeypatch.setattr(_digest, "_ROW_WORDS", 4)
    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    assert digest(wide) == expected
    assert sizes and max(sizes) <= 256


def test_sync_in_a_world_of_one_sends_nothing():
    t = torch.ones(3)
    assert sync_tensors([t]) == 0 and sync_tensors([]) == 0
    assert t.tolist() == [1.0, 1.0, 1.0]
