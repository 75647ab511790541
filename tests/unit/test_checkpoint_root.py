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


def test_torchrun_without_a_run_id_does_not_make_two_jobs_one(tmp_path, monkeypatch):
    # torchrun without --standalone or --rdzv-id gives every job the run id "none"
    root, model = tmp_path / "ckpt", TinyNet()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
        claim(root, pid=sleeper.pid, run_id="none")
        with pytest.raises(RuntimeError, match=rf"another live job \(host {fs._HOST}, pid {sleeper.pid}"):
            torchacc.save_checkpoint(root, model=model)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_writer_that_claims_between_read_and_write_wins(tmp_path, monkeypatch):
    # two jobs saving at the same moment both read "no writer": only one may then claim the root
    from torchacc.checkpoint import one_writer

    root, model = tmp_path / "ckpt", TinyNet()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    real_read = one_writer._read_writer
    reads = []

    def read_before_the_other_claims(path):
        if not reads:  # the other job's claim lands right after this job's first read
            reads.append(path)
            claim(root, pid=sleeper.pid)
            return None
        return real_read(path)

    try:
        root.mkdir()
        monkeypatch.setattr(one_writer, "_read_writer", read_before_the_other_claims)
        with pytest.raises(RuntimeError, match=rf"another live job \(host {fs._HOST}, pid {sleeper.pid}"):
            torchacc.save_checkpoint(root, model=model)
        assert json.loads((root / WRITER).read_text())["pid"] == sleeper.pid, "the first claim stands"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_leftover_cleanup_touches_only_what_torchacc_wrote(tmp_path):
    root, model = tmp_path / "ckpt", TinyNet()
    torchacc.save_checkpoint(root, model=model)
    (root / ".cache.incomplete").mkdir()
    (root / ".cache.incomplete" / "data.bin").write_bytes(b"mine")
    (root / ".mydata.replaced").mkdir()
    (root / ".notes.incomplete").write_text("a file, not a folder")
    torchacc.save_checkpoint(root, model=model)  # cleans the leftovers of killed saves: none of these
    assert (root / ".cache.incomplete" / "data.bin").read_bytes() == b"mine"
    assert (root / ".mydata.replaced").is_dir() and not (root / "mydata").exists()
    assert (root / ".notes.incomplete").read_text() == "a file, not a folder"
    (root / "checkpoint-9").mkdir()  # a user's folder under a tag's name is not replaced either
    with pytest.raises(RuntimeError, match=r"checkpoint-9'? .*not written by torchacc.*another tag"):
        torchacc.save_checkpoint(root, model=model, tag="checkpoint-9")
    assert os.listdir(root / "checkpoint-9") == []


def test_a_missing_checksum_manifest_is_refused(tmp_path):
    root, model = tmp_path / "ckpt", TinyNet()
    path = Path(torchacc.save_checkpoint(root, model=model))
    (path / "checksums.json").unlink()
    with pytest.raises(ValueError, match=r"checksums.json.* missing.*written with one.*verify=False"):
        torchacc.load_checkpoint(path, model=TinyNet())
    torchacc.load_checkpoint(path, model=TinyNet(), verify=False)


def test_state_that_would_not_load_back_is_refused_at_save(tmp_path):
    import numpy as np

    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=np.float64(1e-3))
    with pytest.raises(ValueError, match=r"optimizer state \(param_groups\) holds values .*numpy.*float\(value\)"):
        torchacc.save_checkpoint(tmp_path / "ckpt", model=model, optimizer=optimizer)
    assert torchacc.latest_checkpoint(tmp_path / "ckpt") is None


def test_taking_over_a_dead_writer_leaves_one_writer_when_two_jobs_do_it(tmp_path, monkeypatch):
    # both jobs judge the dead claim dead; the other job moves it away and claims first: this job must not move
    # the other's live claim away in turn
    from torchacc.checkpoint import one_writer

    root, model = tmp_path / "ckpt", TinyNet()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    real_rename = os.rename

    def the_other_job_claims_first(src, dst):
        if str(src).endswith(WRITER) and json.loads(Path(src).read_text())["pid"] == dead.pid:
            claim(root, pid=sleeper.pid)  # the other job replaced the dead claim with its own, live one
        return real_rename(src, dst)

    try:
        claim(root, pid=dead.pid)  # this host, process gone: dead
        monkeypatch.setattr(one_writer.os, "rename", the_other_job_claims_first)
        with pytest.raises(RuntimeError, match=rf"another live job \(host {fs._HOST}, pid {sleeper.pid}"):
            torchacc.save_checkpoint(root, model=model)
        assert json.loads((root / WRITER).read_text())["pid"] == sleeper.pid, "the live claim stands"
        assert [n for n in os.listdir(root) if ".tmp-" in n] == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_root_on_a_file_system_without_hard_links_is_claimed(tmp_path, monkeypatch):
    import errno

    from torchacc.checkpoint import one_writer

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(one_writer.os, "link", no_links)
    root = tmp_path / "ckpt"
    assert torchacc.save_checkpoint(root, model=TinyNet()) == str(root / "checkpoint-1")
    assert json.loads((root / WRITER).read_text())["pid"] == os.getpid()
    assert [n for n in os.listdir(root) if ".tmp-" in n] == []


def test_a_users_folder_under_the_staging_name_of_the_saved_tag_is_kept(tmp_path):
    root, model = tmp_path / "ckpt", TinyNet()
    (root / ".checkpoint-1.incomplete").mkdir(parents=True)
    (root / ".checkpoint-1.incomplete" / "mine.txt").write_text("mine")
    with pytest.raises(RuntimeError, match=r"\.checkpoint-1\.incomplete.*not written by torchacc"):
        torchacc.save_checkpoint(root, model=model, tag="checkpoint-1")
    assert (root / ".checkpoint-1.incomplete" / "mine.txt").read_text() == "mine"


def test_a_damaged_claim_blocks_until_stale_and_then_gives_way(tmp_path):
    root, model = tmp_path / "ckpt", TinyNet()
    root.mkdir()
    (root / WRITER).write_text('{"host": "' + fs._HOST + '", "pid": "not a number"}')  # no crash on any rank
    with pytest.raises(RuntimeError, match=r"another live job \(host .*, pid not a number"):
        torchacc.save_checkpoint(root, model=model)
    old = time.time() - 3600
    os.utime(root / WRITER, (old, old))
    assert torchacc.save_checkpoint(root, model=model) == str(root / "checkpoint-1")
