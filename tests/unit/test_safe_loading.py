"""Loading runs no code from a file unless the caller opts in (weights_only=False): every loading entry point.

Each payload's ``__reduce__`` would create a marker file when unpickled; the marker must not appear, and
the error must name the opt-in.
"""

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _models import TinyNet

import torchacc

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
REFUSED = r"refused to load: it holds pickled objects that could run code .*load it with weights_only=False"


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def dcp_checkpoint(tmp_path: Path, entry: str) -> Path:
    """A DCP checkpoint of TinyNet whose ``entry`` holds the payload (written as any tool could)."""
    model = TinyNet()
    state = {f"model/{k}": v for k, v in model.state_dict().items()}
    state[entry] = RunsCode(tmp_path / "ran")
    state["torchacc"] = b"not read before the entry"
    directory = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    return directory


def test_torchacc_load_refuses_code_and_runs_it_only_when_asked(tmp_path):
    torch.save({"x": RunsCode(tmp_path / "ran")}, tmp_path / "code.pth")
    for verify in (False, True):
        with pytest.raises(ValueError, match=REFUSED):
            torchacc.load(tmp_path / "code.pth", verify=verify)
    assert not (tmp_path / "ran").exists()
    torchacc.load(tmp_path / "code.pth", weights_only=False)  # the documented opt-in for trusted files
    assert (tmp_path / "ran").exists()


@pytest.mark.parametrize("entry", ["extra/rank-0", "extra"])
def test_load_checkpoint_and_resume_latest_refuse_code_in_extra(tmp_path, entry):
    directory = dcp_checkpoint(tmp_path, entry)
    with pytest.raises(ValueError, match=REFUSED):
        torchacc.load_checkpoint(directory, model=TinyNet())
    (tmp_path / "root").mkdir()
    directory.rename(tmp_path / "root" / "checkpoint-1")
    (tmp_path / "root" / "latest").write_text("checkpoint-1")
    with pytest.raises(ValueError, match=REFUSED):
        torchacc.resume_latest(tmp_path / "root", TinyNet())
    assert not (tmp_path / "ran").exists()


def test_a_checkpoint_whose_metadata_runs_code_is_refused(tmp_path):
    model = TinyNet()
    torchacc.save_checkpoint(tmp_path / "root", model=model)
    metadata = tmp_path / "root" / "checkpoint-1" / ".metadata"
    metadata.write_bytes(pickle.dumps(RunsCode(tmp_path / "ran")))
    (metadata.parent / "checksums.json").unlink()  # whoever crafted the file would rewrite the checksums too
    with pytest.raises(ValueError, match=r"\.metadata: refused to load"):
        torchacc.load_checkpoint(tmp_path / "root", model=model, verify=False)
    assert not (tmp_path / "ran").exists()


def test_a_checkpoint_of_this_version_loads_with_the_defaults(tmp_path):
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3)
    extra = {"step": 7, "rng": torch.get_rng_state(), "names": ["a", "b"], "nested": {"t": (1, 2.5)}}
    torchacc.save_checkpoint(tmp_path / "root", model=model, optimizer=optimizer, scheduler=scheduler, extra=extra)
    loaded = torchacc.resume_latest(tmp_path / "root", model, optimizer, scheduler=scheduler)
    assert loaded.keys() == extra.keys() and torch.equal(loaded["rng"], extra["rng"])
    assert loaded["nested"] == {"t": (1, 2.5)} and loaded["names"] == ["a", "b"]


def test_strategy_loads_refuse_code(tmp_path):
    strategy = torchacc.FSDP2Strategy()
    strategy.setup_environment()
    model = strategy.parallelize(TinyNet())
    torch.save({"state_dict": model.state_dict(), "epoch": RunsCode(tmp_path / "ran")}, tmp_path / "full.pth")
    with pytest.raises(ValueError, match=REFUSED):
        strategy.load_checkpoint(tmp_path / "full.pth")
    directory = dcp_checkpoint(tmp_path, "epoch")
    with pytest.raises(ValueError, match=REFUSED):
        strategy.load_checkpoint(directory)
    directory.rename(tmp_path / "epoch-ckpt")
    directory = dcp_checkpoint(tmp_path, "extra/rank-0")
    (tmp_path / "root").mkdir()
    directory.rename(tmp_path / "root" / "checkpoint-1")
    (tmp_path / "root" / "latest").write_text("checkpoint-1")
    with pytest.raises(ValueError, match=REFUSED):
        strategy.load_ckpt(model, tmp_path / "root")
    assert not (tmp_path / "ran").exists()
