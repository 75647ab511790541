"""The capacity benchmark still runs: every contender at depth 1, in one job (figures are not checked)."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "capacity.py"


def test_capacity_quick():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for contender in ("ddp", "ddp-bv", "torchacc"):
        assert f"| {contender} | 1 |" in proc.stdout, proc.stdout
    assert "torchacc / ddp parameters:" in proc.stdout
