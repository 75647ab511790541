"""A truncated, bit-flipped or missing checkpoint file is detected (checksums recorded at save) and named.

``torchacc.save`` files carry the zip CRC-32 of every member; ``save_checkpoint`` directories carry
``checksums.json`` (size and CRC-32 of every file). Loading a damaged one raises ValueError naming the file,
it never returns wrong tensors. The same at 2 ranks is in test_rank_failures.py.
"""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from _models import TinyNet

import torchacc

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: int | None = None) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2 if keep is None else keep])


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def saved_file(tmp_path):
    state = TinyNet().state_dict()
    path = tmp_path / "model.pth"
    torchacc.save(state, path)
    assert same_state(torchacc.load(path, verify=True), state)
    return path


@pytest.fixture
def dcp_checkpoint(tmp_path):
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    path = Path(torchacc.save_checkpoint(tmp_path / "ckpt", model=model, optimizer=optimizer, extra={"step": 1}))
    data = next(path.glob("*.distcp"))
    return path, data, model.state_dict()


def load_into_fresh(path: Path, **kwargs) -> dict:
    model = TinyNet()
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    torchacc.load_checkpoint(path, model=model, **kwargs)
    return model.state_dict()


def test_torchacc_save_truncated_file_is_named(saved_file):
    truncate(saved_file)
    for verify in (True, False):
        with pytest.raises(ValueError, match=rf"{re.escape(str(saved_file))}: (truncated|cannot be read)"):
            torchacc.load(saved_file, verify=verify)


def test_torchacc_save_bit_flip_is_caught_by_the_recorded_crc(saved_file):
    flip_byte(saved_file, offset=saved_file.stat().st_size // 3)
    with pytest.raises(ValueError, match=rf"{re.escape(str(saved_file))}: .*(CRC-32|truncated)"):
        torchacc.load(saved_file, verify=True)


def test_the_checkpoint_records_size_and_crc_of_every_file(dcp_checkpoint):
    path, _, _ = dcp_checkpoint
    files = json.loads((path / "checksums.json").read_text())["files"]
    assert set(files) == {name for name in os.listdir(path) if name != "checksums.json"}
    assert ".metadata" in files and any(name.endswith(".distcp") for name in files)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_data_file_is_named_by_load_checkpoint(dcp_checkpoint, damage):
    path, data, _ = dcp_checkpoint
    {"truncate": truncate, "flip": flip_byte, "delete": os.remove}[damage](data)
    what = {"truncate": r"\d+ bytes, but \d+ were written at save", "flip": "CRC-32 .* differs", "delete": "missing"}[
        damage
    ]
    with pytest.raises(ValueError, match=rf"load_checkpoint.*{re.escape(str(data))}: {what}.*earlier checkpoint"):
        load_into_fresh(path.parent)


def test_bit_flip_in_the_metadata_is_named(dcp_checkpoint):
    path, _, _ = dcp_checkpoint
    flip_byte(path / ".metadata")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path / '.metadata'))}: CRC-32"):
        load_into_fresh(path)


def test_truncation_is_caught_without_the_crc_pass(dcp_checkpoint):
    path, data, _ = dcp_checkpoint
    truncate(data)
    with pytest.raises(ValueError, match=rf"{re.escape(str(data))}: \d+ bytes, but \d+ were written"):
        load_into_fresh(path, verify=False)


def test_damaged_manifest_is_named(dcp_checkpoint):
    path, _, _ = dcp_checkpoint
    (path / "checksums.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"checksums.json: unreadable checksum manifest.*damaged"):
        load_into_fresh(path)


def test_checkpoint_without_manifest_still_names_a_truncated_file(dcp_checkpoint):
    """A checkpoint written before checksums existed: the DCP metadata's offsets still name the short file."""
    path, data, _ = dcp_checkpoint
    os.remove(path / "checksums.json")
    marker = path / "torchacc-checkpoint.json"  # as written then: no promise of a manifest
    marker.write_text(json.dumps({"format": "torchacc-checkpoint/1", "tag": path.name}))
    truncate(data, keep=100)
    with pytest.raises(ValueError, match=rf"{re.escape(str(data))}: \d+ bytes, but the checkpoint's .metadata needs"):
        load_into_fresh(path)


def test_resume_never_falls_back_silently_from_a_damaged_latest(dcp_checkpoint):
    path, data, state = dcp_checkpoint
    assert same_state(load_into_fresh(path.parent), state)
    flip_byte(data)
    with pytest.raises(ValueError, match="CRC-32"):
        torchacc.resume_latest(path.parent, TinyNet())


def test_consolidation_names_a_bit_flipped_shard(tmp_path):
    from test_bad_input import write_shard_set

    pattern = write_shard_set(tmp_path, {0: 2, 1: 2})
    flip_byte(tmp_path / "r1.pth", offset=(tmp_path / "r1.pth").stat().st_size // 3)
    with pytest.raises(ValueError, match=r"r1.pth: (member .* fails its CRC-32 check|truncated)"):
        torchacc.consolidate(pattern)
