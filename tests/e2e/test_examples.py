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


# ---- the examples added for the docs: quick modes --------------------------------------------------


def test_yaml_config_is_the_default_run_of_train_gpt2():
    import torchacc

    default = torchacc.Config()  # what train_gpt2.py builds from its flags on 2 ranks
    default.dist.fsdp.size = 2
    default.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    assert torchacc.Config.from_yaml(ROOT / "examples" / "train_gpt2.yaml") == default


def test_consolidate_sh_trains_from_yaml_consolidates_exports_and_generates(tmp_path):
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "STEPS": "4",
        "OVERRIDES": "memory.gc=true dataloader.seed=3",
    }
    cmd = ["bash", str(ROOT / "examples" / "consolidate.sh"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{out[-3000:]}\n{proc.stderr[-6000:]}"
    assert "gc: true" in out and "seed: 3" in out and "- GPT2Block" in out  # the YAML, then the overrides
    assert "after 4 steps on 2 rank(s)" in out
    shards = tmp_path / "shards"
    assert {p.name for p in shards.glob("rank-*")} == {
        f"rank-{r}-of-2-{k}.pth" for r in (0, 1) for k in ("model", "optim")
    }
    assert (shards / "consolidated.pth").is_file() and (shards / "consolidated_optim.pth").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert "generated: 'the" in out and f"logits match {shards / 'consolidated.pth'}" in out


def test_cnn_example_trains_with_fsdp_over_conv_blocks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    out = run(cmd + [str(ROOT / "examples" / "train_cnn.py"), "--steps", "8"])
    match = re.search(r"loss ([\d.]+) -> ([\d.]+), held-out accuracy (\d+)% after 8 steps on 2 rank", out)
    assert match, out[-2000:]
    first, last, accuracy = float(match.group(1)), float(match.group(2)), int(match.group(3))
    assert last < 0.7 * first and accuracy > 40
