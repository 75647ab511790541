"""The checkpoint root in one process: rotation (``keep=``), one writer per root, and a save in the background
published at exit."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _models import TinyNet

import torchacc
from torchacc._utils import fs
from torchacc.checkpoint.directory import WRITER

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_keep_removes_only_its_own_older_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=root / "my-export", no_dist=True)  # a user's DCP folder
    (root / "notes").mkdir()
    model = TinyNet()
    for step in range(4):
        path = torchacc.save_checkpoint(root, model=model, extra={"step": step}, keep=2)
        assert torchacc.latest_checkpoint(root) == path
    names = sorted(n for n in os.listdir(root) if n != WRITER)
    assert names == ["checkpoint-3", "checkpoint-4", "latest", "my-export", "notes"]
    torchacc.save_checkpoint(root, model=model, tag="checkpoint-4", keep=1)  # the re-saved latest stays
    assert sorted(n for n in os.listdir(root) if n.startswith("checkpoint")) == ["checkpoint-4"]
    with pytest.raises(ValueError, match=r"keep=0 must be None \(keep every checkpoint\) or an int >= 1"):
        torchacc.save_checkpoint(root, model=model, keep=0)


def claim(root: Path, **fields) -> None:
    root.mkdir(exist_ok=True)
    writer = {"host": fs._HOST, "pid": 1, "run_id": "", "token": "another-job", **fields}
    (root / WRITER).write_text(json.dumps(writer))


def test_a_second_live_writer_is_refused_and_a_dead_one_does_not_block(tmp_path, monkeypatch):
    root, model = tmp_path / "ckpt", TinyNet()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        claim(root, pid=sleeper.pid)
        with pytest.raises(
            RuntimeError, match=rf"another live job \(host {fs._HOST}, pid {sleeper.pid}, .*stop that job"
        ):
            torchacc.save_checkpoint(root, model=model)
        assert sorted(os.listdir(root)) == [WRITER], "refused before anything was written"
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")  # an earlier attempt of the same torchrun job
        claim(root, pid=sleeper.pid, run_id="job-7")
        torchacc.save_checkpoint(root, model=model)
        claim(root, pid=sleeper.pid, host="elsewhere")  # another host: only its heartbeat tells
        with pytest.raises(RuntimeError, match=r"host elsewhere, pid"):
            torchacc.save_checkpoint(root, model=model)
        old = time.time() - 3600
        os.utime(root / WRITER, (old, old))  # no heartbeat for an hour: dead
        torchacc.save_checkpoint(root, model=model)
    finally:
        sleeper.kill()
        sleeper.wait()
    claim(root, pid=sleeper.pid)  # this host, process gone
    assert torchacc.save_checkpoint(root, model=model) == str(root / "checkpoint-3")
    assert json.loads((root / WRITER).read_text())["pid"] == os.getpid()


SCRIPT = """
import sys
import torchacc
from _models import TinyNet

handle = torchacc.save_checkpoint(sys.argv[1], model=TinyNet(), extra={"step": 1}, blocking=False)
print(handle.path)
"""


def test_a_save_still_in_flight_is_published_at_exit(tmp_path):
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(root)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert torchacc.latest_checkpoint(root) == proc.stdout.strip() == str(root / "checkpoint-1")
    assert sorted(os.listdir(root)) == ["checkpoint-1", "latest"], "no staging left, the writer's claim released"
    assert torchacc.load_checkpoint(root, model=TinyNet()) == {"step": 1}
