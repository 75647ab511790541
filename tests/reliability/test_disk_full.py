"""Disk full during a save: a clear error naming the path, the previous checkpoint intact, no temporary files left.

The full disk is simulated by making the writer raise ``OSError(ENOSPC)`` part-way through, after it has
already written some bytes, at each stage of a save. The same with one rank of two is in test_rank_failures.py.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from _faults import disk_full, inject, raising
from _models import TinyNet

import torchacc
import torchacc.checkpoint.directory
import torchacc.checkpoint.storage
from torchacc._utils.fs import atomic_write

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def leftovers(directory: Path) -> list[str]:
    """Anything a save may leave behind when it fails or dies."""
    return sorted(n for n in os.listdir(directory) if ".tmp-" in n or n.endswith((".incomplete", ".replaced")))


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_torchacc_save_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "model.pth"
    before = TinyNet().state_dict()
    torchacc.save(before, path)
    real_save = torch.save

    def half_then_full(obj, target, *args, **kwargs):
        real_save(obj, target, *args, **kwargs)
        Path(target).write_bytes(Path(target).read_bytes()[:1000])  # what reached the disk before it filled up
        raise disk_full()

    monkeypatch.setattr(torch, "save", half_then_full)
    with pytest.raises(
        RuntimeError,
        match=rf"torchacc.save\('{path}'\) failed: no space left on the device of "
        rf"'{tmp_path}' while writing '{path}'.*free space and save again",
    ):
        torchacc.save({"w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert same_state(torchacc.load(path, verify=True), before)
    assert leftovers(tmp_path) == []


@pytest.fixture
def checkpointed(tmp_path):
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    directory = tmp_path / "ckpt"
    torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 1})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    return directory, model, optimizer, expected


def assert_previous_checkpoint_intact(directory: Path, expected: dict) -> None:
    assert torchacc.latest_checkpoint(directory) == str(directory / "checkpoint-1")
    model = TinyNet()
    assert torchacc.resume_latest(directory, model, torch.optim.AdamW(model.parameters())) == {"step": 1}
    assert same_state(model.state_dict(), expected)


@pytest.mark.parametrize("stage", ["data-file", "metadata", "checksums"])
def test_save_checkpoint_fails_cleanly_at_every_stage(checkpointed, stage, monkeypatch):
    directory, model, optimizer, expected = checkpointed
    staging = directory / ".checkpoint-2.incomplete"
    patch = monkeypatch.setattr
    if stage == "data-file":
        inject(dcp_fs, "_write_item", raising(disk_full), nth=3, patch=patch)
    elif stage == "metadata":
        inject(dcp_fs.FileSystemWriter, "finish", raising(lambda: disk_full(staging / ".metadata.tmp")), patch=patch)
    else:
        full = raising(lambda: disk_full(staging / "checksums.json"))
        inject(torchacc.checkpoint.storage, "atomic_write_text", full, patch=patch)
    with pytest.raises(
        RuntimeError,
        match=rf"save_checkpoint\('{directory}'\) failed: .*no space left on the "
        rf"device of '{directory}.*free space and save again.*nothing was saved and 'latest' is "
        "unchanged",
    ):
        torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 2})
    monkeypatch.undo()
    assert leftovers(directory) == []
    assert_previous_checkpoint_intact(directory, expected)


def test_disk_full_while_moving_latest_names_the_pointer(checkpointed, monkeypatch):
    directory, model, optimizer, expected = checkpointed

    def partial_then_full(tmp):
        with open(tmp, "w") as f:
            f.write("che")
        raise disk_full()

    monkeypatch.setattr(
        torchacc.checkpoint.directory, "atomic_write_text", lambda path, text: atomic_write(path, partial_then_full)
    )
    with pytest.raises(
        RuntimeError,
        match=rf"no space left on the device of '{directory}' while writing "
        rf"'{directory}/latest'",
    ):
        torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 2})
    monkeypatch.undo()
    assert leftovers(directory) == []
    assert_previous_checkpoint_intact(directory, expected)
    # The new checkpoint is complete but never became latest; the next save goes past it.
    assert os.path.isfile(directory / "checkpoint-2" / ".metadata")
    assert torchacc.save_checkpoint(directory, model=model) == str(directory / "checkpoint-3")
