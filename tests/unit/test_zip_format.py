"""torchacc's own writer of torch's zip container, and consolidation that copies shard bytes file to file."""

import os
import random
import threading
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import torchacc
from torchacc.checkpoint._format import file_ranges as _file_ranges
from torchacc.checkpoint._format import zip as _zip
from torchacc.checkpoint._format.file_ranges import FileRange
from torchacc.checkpoint._format.torch_writer import StreamingTorchWriter, TensorSlot
from torchacc.checkpoint.files import verify_file
from torchacc.checkpoint.offline.shard_set import ShardSet
from torchacc.checkpoint.state import FORMAT, local_slice


def test_crc32_combine_matches_zlib():
    rng = random.Random(0)
    for _ in range(100):
        a, b = rng.randbytes(rng.randrange(300)), rng.randbytes(rng.randrange(300))
        assert _file_ranges.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def write_streamed(path: Path, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """``tensors`` through a StreamingTorchWriter; ``w`` is copied from ``source``'s record in two ranges."""
    torch.save(tensors["w"], source)
    ((offset, (_, size, _)),) = [(o, v) for o, v in _zip.record_table(str(source)).items() if "/data/" in v[0]]
    slots = {key: TensorSlot(str(i), value.shape, value.dtype) for i, (key, value) in enumerate(tensors.items())}
    with StreamingTorchWriter(path, {"model": dict(slots), "tied": slots["w"], "plain": [1, "a"]}) as writer:
        for key, value in tensors.items():
            if key == "w":
                halves = [FileRange(str(source), offset, 24), FileRange(str(source), offset + 24, size - 24)]
                writer.copy(slots[key], halves)
            else:
                writer.write(slots[key], value)


TENSORS = {
    "w": torch.randn(5, 3),
    "i": torch.arange(7),
    "h": torch.randn(4).bfloat16(),
    "scalar": torch.tensor(3.0),
    "empty": torch.zeros(0, 2),
}


@pytest.mark.parametrize("zip64", [False, True], ids=["zip32", "zip64-fields"])
def test_streamed_file_reads_like_torch_save(tmp_path, monkeypatch, zip64):
    if zip64:  # every size and offset takes the zip64 path that files past 4 GiB need
        monkeypatch.setattr(_zip, "_ZIP32_LIMIT", 16)
    path = tmp_path / "out.pt"
    write_streamed(path, TENSORS, tmp_path / "src.pt")
    verify_file(path)
    assert zipfile.ZipFile(path).testzip() is None
    for mmap in (False, True):
        loaded = torch.load(path, mmap=mmap, weights_only=True)
        for key, value in TENSORS.items():
            assert loaded["model"][key].dtype == value.dtype and torch.equal(loaded["model"][key], value), key
        assert loaded["tied"].data_ptr() == loaded["model"]["w"].data_ptr()
        assert loaded["plain"] == [1, "a"]


def test_streamed_file_keeps_torch_s_layout_for_computed_offsets(tmp_path, monkeypatch):
    """torch can compute record offsets instead of reading headers; that assumes miniz's exact layout."""
    from torch.utils.serialization import config

    path = tmp_path / "out.pt"
    write_streamed(path, TENSORS, tmp_path / "src.pt")
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")  # checks each computed offset against the header
    with config.patch({"load.calculate_storage_offsets": True}):
        loaded = torch.load(path, mmap=True, weights_only=True)
    assert torch.equal(loaded["model"]["w"], TENSORS["w"])


def test_copy_moves_ranges_larger_than_its_buffer_and_names_a_truncated_source(tmp_path, monkeypatch):
    monkeypatch.setattr(_file_ranges, "_COPY_BUFFER", 7)  # every range takes several reads, none of them aligned
    monkeypatch.setattr(_file_ranges, "_buffers", threading.local())
    write_streamed(tmp_path / "out.pt", TENSORS, tmp_path / "src.pt")
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["model"]["w"], TENSORS["w"])
    source = tmp_path / "short.bin"
    source.write_bytes(b"x" * 10)
    with open(tmp_path / "dst.bin", "wb") as dst, pytest.raises(ValueError, match=r"short.bin: ends before byte 12"):
        _file_ranges.copy_ranges([FileRange(str(source), 2, 10)], dst.fileno(), 0)


def write_shards(directory: Path, full: dict[str, torch.Tensor], placement: str, *, views: bool) -> str:
    """Per-rank files of ``full`` split 2 ways by ``placement``. ``views``: save the pieces as views of a
    larger (padded) storage, as FSDP2 on the CPU does, so records hold more bytes than the tensor."""
    for rank in range(2):
        mesh = {"shape": [2], "dim_names": ["fsdp"], "coordinate": [rank]}
        local, tensors = {}, {}
        for name, value in full.items():
            dim = int(placement.split(":")[1])
            here = placement if value.dim() > dim else "shard:0"
            offset, shape = local_slice(tuple(value.shape), [here], [2], [rank])
            piece = value[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].clone()
            if views:
                padded = torch.zeros(piece.numel() + 3, dtype=piece.dtype)
                padded[: piece.numel()] = piece.reshape(-1)
                piece = padded[: piece.numel()].view(piece.shape)
            local[name] = piece
            tensors[name] = {"kind": "param", "dtype": str(value.dtype), "shape": list(value.shape)}
            tensors[name].update(placements=[here], offset=offset, local_shape=shape)
        meta = {"format": FORMAT, "world_size": 2, "rank": rank, "mesh": mesh, "tensors": tensors}
        torch.save({"model": local, "shard_metadata": meta}, directory / f"rank-{rank}-of-2-model.pth")
    return str(directory / "rank-*-of-2-model.pth")


FULL = {"a": torch.randn(5, 4), "b": torch.randn(3), "c": torch.randn(4, 2).double()}


@pytest.mark.parametrize(
    "placement, views, copied",
    [("shard:0", False, True), ("shard:0", True, True), ("shard:1", False, False)],
    ids=["dim0", "dim0-padded-storage", "dim1-rebuilt-in-memory"],
)
def test_consolidation_copies_dim0_shards_and_rebuilds_the_rest(tmp_path, placement, views, copied):
    pattern = write_shards(tmp_path, FULL, placement, views=views)
    shards = ShardSet(pattern)
    assert all((shards.byte_ranges(item) is not None) == (copied or len(item.shape) == 1) for item in shards.items)
    out = tmp_path / "out.pth"
    torchacc.consolidate(pattern, out=out, return_state=False)
    verify_file(out)
    streamed = torch.load(out, weights_only=True)["model"]
    returned = torchacc.consolidate(pattern)["model"]
    for name, value in FULL.items():
        assert torch.equal(streamed[name], value) and torch.equal(returned[name], value), name
    resharded = torchacc.reshard_checkpoint(tmp_path, tmp_path / "re", num_shards=3)
    assert len(resharded) == 3
    again = torchacc.consolidate(str(tmp_path / "re" / "rank-*-of-3-model.pth"))["model"]
    assert all(torch.equal(again[name], value) for name, value in FULL.items())


def test_a_corrupt_tensor_found_while_copying_writes_nothing(tmp_path):
    pattern = write_shards(tmp_path, {"a": torch.randn(64, 64)}, "shard:0", views=False)
    path = tmp_path / "rank-1-of-2-model.pth"
    data = bytearray(path.read_bytes())
    ((offset, _),) = [(o, v) for o, v in _zip.record_table(str(path)).items() if "/data/" in v[0]]
    data[offset + 100] ^= 0x01
    path.write_bytes(bytes(data))
    out = tmp_path / "out" / "consolidated.pth"
    out.parent.mkdir()
    corrupt = r"rank-1-of-2-model.pth: member .*data/0.* fails its CRC-32 check; the file is corrupt"
    with pytest.raises(ValueError, match=corrupt):  # found by the copy itself, which reads the whole record
        torchacc.consolidate(pattern, out=out, return_state=False)
    assert not list(out.parent.iterdir())
    with pytest.raises(ValueError, match=corrupt):
        torchacc.consolidate(pattern)  # return mode: found by the checking thread
    with pytest.raises(ValueError, match=corrupt):
        torchacc.consolidate(pattern, out=tmp_path / "out" / "model.safetensors", fmt="safetensors", return_state=False)
    assert not list(out.parent.iterdir())
    with pytest.raises(ValueError, match=r"rank-1-of-2-model.pth: member .* fails its CRC-32 check"):
        torchacc.reshard_checkpoint(tmp_path, tmp_path / "re", num_shards=1)
    assert not list((tmp_path / "re").glob("*"))


@pytest.mark.parametrize("sync_files", [True, False], ids=["sync", "no-sync"])
def test_sync_files_decides_whether_outputs_are_flushed_to_disk(tmp_path, monkeypatch, sync_files):
    pattern = write_shards(tmp_path, {"a": torch.randn(64, 64), "b": torch.randn(9)}, "shard:0", views=False)
    calls = []
    real_fsync, real_fadvise = os.fsync, getattr(os, "posix_fadvise", None)
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or real_fsync(fd))
    if real_fadvise is not None:
        monkeypatch.setattr(os, "posix_fadvise", lambda *a: calls.append("fadvise") or real_fadvise(*a))
    outputs = {"torch": tmp_path / "out.pth", "safetensors": tmp_path / "out.safetensors"}
    for fmt, out in outputs.items():
        torchacc.consolidate(pattern, out=out, fmt=fmt, return_state=False, sync_files=sync_files)
    torchacc.reshard_checkpoint(tmp_path, tmp_path / "re", num_shards=3, sync_files=sync_files)
    expected = {"fsync", "fadvise"} if real_fadvise is not None else {"fsync"}
    assert set(calls) == (expected if sync_files else set())
    full = torchacc.consolidate(pattern)["model"]
    assert torch.equal(torch.load(outputs["torch"], weights_only=True)["model"]["a"], full["a"])
    again = torchacc.consolidate(str(tmp_path / "re" / "rank-*-of-3-model.pth"))["model"]
    assert all(torch.equal(again[name], value) for name, value in full.items())
    assert not list(tmp_path.glob("*.tmp-*"))


def test_cli_no_sync_consolidates_and_refuses_hf(tmp_path, capsys):
    from torchacc.cli import main

    write_shards(tmp_path, {"a": torch.randn(8, 4)}, "shard:0", views=False)
    assert main(["consolidate", "--ckpt-dir", str(tmp_path), "--no-sync", "--quiet"]) == 0
    assert torch.load(tmp_path / "consolidated.pth", weights_only=True)["model"]["a"].shape == (8, 4)
    assert main(["consolidate", "--ckpt-dir", str(tmp_path), "--format", "hf", "--no-sync"]) == 1
    assert "--no-sync changes nothing; drop it" in capsys.readouterr().err


def test_a_corrupt_record_copied_in_part_is_found_by_the_checking_thread(tmp_path):
    # padded storages (FSDP2 on the CPU): the copy reads only part of each record, so it cannot check it
    pattern = write_shards(tmp_path, {"a": torch.randn(64, 64)}, "shard:0", views=True)
    path = tmp_path / "rank-0-of-2-model.pth"
    data = bytearray(path.read_bytes())
    ((offset, (_, size, _)),) = [(o, v) for o, v in _zip.record_table(str(path)).items() if "/data/" in v[0]]
    data[offset + size - 1] ^= 0x01  # in the padding, which no output holds: still a corrupt file
    path.write_bytes(bytes(data))
    out = tmp_path / "out" / "consolidated.pth"
    out.parent.mkdir()
    with pytest.raises(ValueError, match=r"rank-0-of-2-model.pth: member .*data/0.* fails its CRC-32 check"):
        torchacc.consolidate(pattern, out=out, return_state=False)
    assert not list(out.parent.iterdir())


def test_copy_checks_a_whole_record_only_when_asked(tmp_path):
    source = tmp_path / "src.bin"
    source.write_bytes(bytes(range(200)))
    good = FileRange(str(source), 10, 100, zlib.crc32(bytes(range(10, 110))), "archive/data/0")
    bad = FileRange(str(source), 10, 100, good.crc ^ 1, "archive/data/0")
    with open(tmp_path / "dst.bin", "wb") as dst:
        assert _file_ranges.copy_ranges([good], dst.fileno(), 0, check_sources=True) == good.crc
        assert _file_ranges.copy_ranges([bad], dst.fileno(), 0) == bad.crc  # trusted, not computed
        with pytest.raises(ValueError, match=r"src.bin: member 'archive/data/0' fails its CRC-32 check"):
            _file_ranges.copy_ranges([bad], dst.fileno(), 0, check_sources=True)
