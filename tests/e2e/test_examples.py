"""End-to-end: the GPT-2 example trains under torchrun (2 ranks, gloo) and as a plain process."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt2.py"


def run(cmd: list[str], timeout: float = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc.stdout


def final_losses(stdout: str) -> tuple[float, float, int]:
    match = re.search(r"loss ([\d.]+) -> ([\d.]+) after \d+ steps on (\d+) rank", stdout)
    assert match, f"no loss summary in:\n{stdout[-2000:]}"
    return float(match.group(1)), float(match.group(2)), int(match.group(3))


def test_gpt2_example_trains_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE)]
    first, last, ranks = final_losses(run(cmd + ["--steps", "30"]))
    assert ranks == 2
    assert last < 0.6 * first


def test_gpt2_example_runs_as_one_process_without_torchrun():
    first, last, ranks = final_losses(run([sys.executable, str(EXAMPLE), "--steps", "8"]))
    assert ranks == 1
    assert last < first


def test_strategy_loop_trains_rotates_resumes_and_exports(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "examples" / "strategy_loop.py"),
        "--out",
        str(tmp_path),
        "--steps",
        "3",
    ]
    first = run(cmd)
    assert "starting from scratch" in first and "done at step 3" in first
    assert "checkpoints: ['global_step2', 'global_step3', 'latest']" in first
    second = run(cmd)
    assert "resumed from global_step3" in second and "done at step 6" in second
    losses = [float(line.split()[3]) for line in (first + second).splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.n_layer == 2
