"""The benchmark scripts still run: each one's ``--quick`` mode, in a subprocess (figures are not checked)."""

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


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
