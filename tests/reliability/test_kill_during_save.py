"""SIGKILL in the middle of a save: the previous checkpoint still loads, the partial one is never taken as the
latest, and what the killed save left behind is removed by the next save.

One process is enough where the property is per process (``torchacc.save``'s atomic file, and rank 0's
renames in ``save_checkpoint``): the save runs in a forked child that kills itself at the chosen point, and
this process checks the directory. Kills of one rank of a 2-rank ``save_checkpoint`` are at the end.
"""

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from _faults import inject, kill_self, launch_failing, run_forked
from _models import TinyNet

import torchacc
import torchacc.checkpoint.directory
import torchacc.checkpoint.storage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SCENARIOS = str(Path(__file__).with_name("fault_scenarios.py"))


def leftovers(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".tmp-" in n or n.endswith((".incomplete", ".replaced")))


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), value), "b": torch.arange(8.0) + value}


# --- torchacc.save: one atomic file ------------------------------------------------------------------


REAL_SAVE = torch.save


def _half_written_torch_save(obj, target, *args, **kwargs):
    REAL_SAVE(obj, target, *args, **kwargs)
    Path(target).write_bytes(Path(target).read_bytes()[:1000])
    kill_self()


SAVE_POINTS = {
    "before-writing": (lambda: inject(torch, "save", kill_self), "old"),
    "mid-write": (lambda: setattr(torch, "save", _half_written_torch_save), "old"),
    "after-write-before-rename": (lambda: inject(os, "replace", kill_self), "old"),
    "after-rename-before-directory-sync": (lambda: inject(os, "replace", kill_self, after=True), "new"),
}


@pytest.mark.parametrize("point", SAVE_POINTS)
def test_torchacc_save_killed(tmp_path, point):
    path = tmp_path / "model.pth"
    torchacc.save(state(1.0), path)
    arm, survivor = SAVE_POINTS[point]

    def killed_save():
        arm()
        torchacc.save(state(2.0), path)

    assert run_forked(killed_save) == signal.SIGKILL
    # The file under the final name is always complete: the old one, or the new one once renamed.
    assert same_state(torchacc.load(path, verify=True), state(1.0 if survivor == "old" else 2.0))
    torchacc.save(state(3.0), path)
    assert leftovers(tmp_path) == []
    assert same_state(torchacc.load(path, verify=True), state(3.0))


# --- save_checkpoint: the staging directory, the rename and the latest pointer ------------------------


def _is_staging(src, dst, *args, **kwargs) -> bool:
    return str(src).endswith(".incomplete")


def _is_latest(src, dst, *args, **kwargs) -> bool:
    return str(dst).endswith("latest")


CHECKPOINT_POINTS = {
    "mid-data-write": lambda: inject(dcp_fs, "_write_item", kill_self, nth=3),
    "before-metadata": lambda: inject(dcp_fs.FileSystemWriter, "finish", kill_self),
    "mid-checksums": lambda: inject(torchacc.checkpoint.storage, "file_crc32", kill_self),
    "before-rename": lambda: inject(os, "replace", kill_self, when=_is_staging),
    "after-rename-before-latest": lambda: inject(torchacc.checkpoint.directory, "atomic_write_text", kill_self),
    "mid-latest-write": lambda: inject(os, "replace", kill_self, when=_is_latest),
}


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def resumed_state(directory: Path) -> tuple[dict, dict | None]:
    model = TinyNet()
    extra = torchacc.resume_latest(directory, model, torch.optim.AdamW(model.parameters()))
    return model.state_dict(), extra


# A save in the background is killed in its thread (the writing, the checksums) or in wait() (the rest).
BACKGROUND_POINTS = ["mid-data-write", "before-metadata", "mid-checksums", "after-rename-before-latest"]


@pytest.mark.parametrize(
    "point, blocking", [(p, True) for p in CHECKPOINT_POINTS] + [(p, False) for p in BACKGROUND_POINTS]
)
def test_save_checkpoint_killed(tmp_path, point, blocking):
    directory = tmp_path / "ckpt"
    model, optimizer = trained(0)
    torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 1})
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    def killed_save():
        CHECKPOINT_POINTS[point]()
        next_model, next_optimizer = trained(1)
        extra = {"step": 2}
        handle = torchacc.save_checkpoint(
            directory, model=next_model, optimizer=next_optimizer, extra=extra, blocking=blocking
        )
        if not blocking:
            next_model(torch.randn(4, 16)).sum().backward()  # training goes on while the files are written
            next_optimizer.step()
            handle.wait()

    assert run_forked(killed_save) == signal.SIGKILL
    assert torchacc.latest_checkpoint(directory) == str(directory / "checkpoint-1")
    loaded, extra = resumed_state(directory)
    assert extra == {"step": 1} and same_state(loaded, expected)

    torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 3})
    assert leftovers(directory) == []
    assert resumed_state(directory)[1] == {"step": 3}


def test_resave_of_the_latest_tag_killed_between_the_renames(tmp_path):
    """Overwriting the tag ``latest`` names: killed after the old one moved aside, before the new one took its name."""
    directory = tmp_path / "ckpt"
    model, optimizer = trained(0)
    torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 1}, tag="last")
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    def killed_save():
        inject(os, "replace", kill_self, when=_is_staging)
        torchacc.save_checkpoint(directory, model=trained(1)[0], extra={"step": 2}, tag="last")

    assert run_forked(killed_save) == signal.SIGKILL
    assert not (directory / "last").exists() and (directory / ".last.replaced").is_dir()
    assert torchacc.latest_checkpoint(directory) == str(directory / ".last.replaced")
    loaded, extra = resumed_state(directory)
    assert extra == {"step": 1} and same_state(loaded, expected)

    torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 3})
    assert leftovers(directory) == []
    assert (directory / "last" / ".metadata").is_file(), "the next save restores the moved-aside checkpoint"


# --- one rank of two killed inside save_checkpoint ---------------------------------------------------

RANK_POINTS = ["rank1-mid-write", "rank0-before-rename", "rank0-before-latest"]


@pytest.mark.parametrize("point", RANK_POINTS)
def test_save_checkpoint_with_a_rank_killed(tmp_path, point):
    result = launch_failing(f"{SCENARIOS}:killed_save", 2, tmp_path / "logs", args=(tmp_path, point))
    killed = int(point[4])
    assert result["codes"][killed] == -signal.SIGKILL, result["logs"][killed][-3000:]
    assert result["codes"][1 - killed] != 0, "the surviving rank must fail too, not finish or hang"
    assert "RuntimeError" in (tmp_path / f"survivor-rank{1 - killed}.txt").read_text(), "it failed inside the save"
    waited = result["ended"] - float((tmp_path / "killed-at").read_text())
    assert waited < 20, f"the surviving rank took {waited:.1f} s to fail; the process-group timeout is 60 s"

    directory = tmp_path / "ckpt"
    assert torchacc.latest_checkpoint(directory) == str(directory / "checkpoint-1")
    loaded, extra = resumed_state(directory)
    assert extra == {"step": 1}
    assert same_state(loaded, torch.load(tmp_path / "expected.pt"))
    model, optimizer = trained(2)
    new = torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 3})
    assert leftovers(directory) == []
    assert torchacc.latest_checkpoint(directory) == new
