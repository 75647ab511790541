"""The benchmark scripts still run: each one's ``--quick`` mode (figures are not checked), in a subprocess or, for
those whose ranks torchrun starts, through ``run_benchmark`` (see [Note: benchmarks in the suite] in conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_consolidate_quick(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(BENCHMARKS / "consolidate.py"), "--quick"]
    cmd += ["--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| variant | time s | min-max s | GB/s |" in proc.stdout, proc.stdout
    for variant in ("torchacc streaming", "torchacc streaming no-sync", "load-everything", "dcp_to_torch_save", "copy"):
        assert f"| `{variant}` |" in proc.stdout, proc.stdout
    assert "torchacc streaming with sync_files=False (no fsync, as copy) >= 70% of copy speed" in proc.stdout
    assert not any((tmp_path / "work").iterdir()), "the temporary checkpoint was not deleted"


def test_setup_time_quick(tmp_path, run_benchmark):
    out = run_benchmark("setup_time.py", "--quick", "--out", str(tmp_path / "setup_time.json"))
    setup_table = out.split("### tensor_digest")[0]
    cells = [line.split(" | ") for line in setup_table.splitlines() if line.startswith("| L2-E128 |")]
    rows = {row[2]: row for row in cells}
    contenders = ["torchacc", "torchacc whole digests", "torchacc full broadcast", "torchacc no sync", "FSDP2"]
    assert sorted(rows) == sorted([*contenders, "torchacc, ranks differ"]), out
    assert rows["torchacc"][6] == rows["torchacc whole digests"][6] == "0", "ranks built alike must send no tensor"
    assert rows["torchacc full broadcast"][6] == rows["torchacc, ranks differ"][6] != "0", out
    assert "| model | param GB | digest ms | digest GB/s |" in out, out
    assert (tmp_path / "setup_time.json").is_file()


def test_plan_accuracy_quick(run_benchmark):
    out = run_benchmark("plan_accuracy.py", "--quick")
    assert "| llama tp=2 | 2 |" in out and "| yes |" in out, out
    assert "### The planner's per-block scaling against a full fake step (CUDA plan)" in out


def test_checkpoint_quick(tmp_path, run_benchmark):
    work = tmp_path / "work"
    work.mkdir()
    out = run_benchmark("checkpoint.py", "--quick", "--workdir", str(work), "--out", str(work / "checkpoint.json"))
    assert "| mode | MB per rank | rounds | in save s | in wait s | blocked s |" in out, out
    for mode in ("blocking", "background", "no save"):
        assert f"| {mode} |" in out, out
    assert os.listdir(work) == ["checkpoint.json"], "the checkpoints were not deleted"
